#version 450
// ConvTranspose as a gather: one invocation per output element sums, over the input channels
// of its group and the kernel taps, the inputs that scatter onto it (o + pad - k*dil must be a
// multiple of the stride and land inside the input). Shapes are defines (one pipeline per
// node); spatial rank ND <= 3, missing dimensions are 1. W is [CIN, COUT/G, k...].
// COLS: the products over the input channels were made beforehand by the tiled GEMM, one per
// output channel and kernel tap: cols[image][co][tap][input position] (col2im); each output
// element then sums at most one value per tap.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf w;
    F32Buf bias;
    F32Buf y;
    F32Buf cols;
} pc;

const int IN_[3] = int[3](IN0, IN1, IN2);
const int OUT_[3] = int[3](OUT0, OUT1, OUT2);
const int K_[3] = int[3](K0, K1, K2);
const int S_[3] = int[3](S0, S1, S2);
const int P_[3] = int[3](P0, P1, P2);
const int D_[3] = int[3](D0, D1, D2);

void main() {
    uint e = flat_index();
    const uint OSIZE = uint(OUT0 * OUT1 * OUT2);
    const uint ISIZE = uint(IN0 * IN1 * IN2);
    const uint KSIZE = uint(K0 * K1 * K2);
    if (e >= uint(N * COUT) * OSIZE) return;
    uint sp = e % OSIZE;
    uint co = (e / OSIZE) % uint(COUT);
    uint n = e / (OSIZE * uint(COUT));
    int o[3] = int[3](int(sp / uint(OUT1 * OUT2)), int((sp / uint(OUT2)) % uint(OUT1)), int(sp % uint(OUT2)));
    const uint COG = uint(COUT / G), CIG = uint(CIN / G);
    uint g = co / COG, cog = co % COG;
    float acc = 0.0;
#if HAS_BIAS
    acc = pc.bias.v[co];
#endif
    for (uint kk = 0; kk < KSIZE; ++kk) {
        int k[3] = int[3](int(kk / uint(K1 * K2)), int((kk / uint(K2)) % uint(K1)), int(kk % uint(K2)));
        uint ioff = 0;
        bool ok = true;
        for (int d = 0; d < 3; ++d) {
            int t = o[d] + P_[d] - k[d] * D_[d];
            if (t < 0 || t % S_[d] != 0 || t / S_[d] >= IN_[d]) { ok = false; break; }
            ioff = ioff * uint(IN_[d]) + uint(t / S_[d]);
        }
        if (!ok) continue;
#if COLS
        acc += pc.cols.v[((n * uint(COUT) + co) * KSIZE + kk) * ISIZE + ioff];
        continue;
#endif
        for (uint c = 0; c < CIG; ++c) {
            uint ci = g * CIG + c;
            acc += pc.x.v[(n * uint(CIN) + ci) * ISIZE + ioff] * pc.w.v[(ci * COG + cog) * KSIZE + kk];
        }
    }
    pc.y.v[e] = acc;
}
