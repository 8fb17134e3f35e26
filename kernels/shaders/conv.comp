#version 450
// Direct convolution, one output element per invocation, for few channels per group and
// depthwise convolutions (wider products go to the implicit GEMM in gemm.comp).
// Geometry is compiled in (defines), spatial dimensions padded to 3 with extent 1:
// C input channels, M output channels, G groups, ID/IH/IW input, OD/OH/OW output,
// KD/KH/KW kernel, SD/SH/SW strides, PD/PH/PW leading pads, DD/DH/DW dilations.
// The sum runs over the input channels c_start .. c_start+c_count-1 of the group: many channels
// run as several dispatches (a device may bound the loop iterations of one invocation), each
// adding to what the last wrote; the last adds the bias and applies the fused Relu.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf w;
    F32Buf b;
    F32Buf y;
    uint n;
    uint c_start;
    uint c_count;
    uint last;
#if HAS_RES
    F32Buf r;  // a residual of y's layout, added before the activation
#endif
} pc;

#define CG (C / G)
#define MG (M / G)

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint ow = i % OW; uint t = i / OW;
    uint oh = t % OH; t /= OH;
    uint od = t % OD; t /= OD;
    uint m = t % M; uint img = t / M;
    uint g = m / MG;
    float acc = pc.c_start > 0 ? pc.y.v[i] : 0.0;
    uint xc = (img * C + g * CG + pc.c_start) * (ID * IH * IW);
    uint wc = m * (CG * KD * KH * KW);
    for (uint c = pc.c_start; c < min(CG, pc.c_start + pc.c_count); ++c) {
        for (uint kd = 0; kd < KD; ++kd) {
            int id = int(od * SD + kd * DD) - PD;
            if (id < 0 || id >= ID) continue;
            for (uint kh = 0; kh < KH; ++kh) {
                int ih = int(oh * SH + kh * DH) - PH;
                if (ih < 0 || ih >= IH) continue;
                uint xrow = xc + (uint(id) * IH + uint(ih)) * IW;
                uint wrow = wc + ((c * KD + kd) * KH + kh) * KW;
                for (uint kw = 0; kw < KW; ++kw) {
                    int iw = int(ow * SW + kw * DW) - PW;
                    if (iw < 0 || iw >= IW) continue;
                    acc = fma(pc.x.v[xrow + uint(iw)], pc.w.v[wrow + kw], acc);
                }
            }
        }
        xc += ID * IH * IW;
    }
    if (pc.last != 0u) {
#if HAS_BIAS
        acc += pc.b.v[m];
#endif
#if HAS_RES
        acc += pc.r.v[i];
#endif
        acc = epilogue(acc);
    }
    pc.y.v[i] = acc;
}
