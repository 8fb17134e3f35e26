#version 450
// A 3x3 convolution of stride 1 by Winograd's F(2x2, 3x3) (kernels/ops/conv.py): the output in
// tiles of 2 x 2, each from a 4 x 4 patch of the input, as 16 products of C-long sums instead of
// 36 multiplications per tile and channel pair. Three stages (STAGE), with a batched product
// (gemm.comp) between the second and the third:
//   1: the weights, U[xi][m][c] = (G g G^T)[xi] for each 3x3 kernel g of output m, input c;
//   2: the input, V[xi][c][t] = (B^T d B)[xi] for each 4x4 patch d of channel c at tile t;
//   (the product: P[xi] = U[xi] @ V[xi], M x T each, sums over C)
//   3: the output, Y = A^T P A for each output m and tile t, plus the bias and the residual,
//      then the fused activation; a tile's outputs past the image's edge are not written.
// xi = 4 * row + column of the 4 x 4 transformed patch. Tiles run over the images, then rows
// of tiles, then tiles in a row: t = (img * TH + ty) * TW + tx. Geometry is compiled in: C
// input and M output channels, IH x IW input, OH x OW output, PH / PW leading pads, TH x TW
// tiles per image, T tiles in all.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#if STAGE == 1
layout(push_constant) uniform Args {
    F32Buf w;   // M x C x 3 x 3
    F32Buf u;   // 16 x M x C
    uint n;     // M * C
} pc;

void main() {
    const uint i = flat_index();  // m * C + c
    if (i >= pc.n) return;
    float g[9];
    for (uint k = 0; k < 9; ++k) g[k] = pc.w.v[i * 9 + k];
    float h[12];  // G g: 4 x 3
    for (uint j = 0; j < 3; ++j) {
        const float a = g[j], b = g[3 + j], c = g[6 + j];
        h[j] = a;
        h[3 + j] = 0.5 * (a + b + c);
        h[6 + j] = 0.5 * (a - b + c);
        h[9 + j] = c;
    }
    for (uint r = 0; r < 4; ++r) {  // (G g) G^T: 4 x 4
        const float a = h[3 * r], b = h[3 * r + 1], c = h[3 * r + 2];
        const uint at = (4 * r) * pc.n + i;
        pc.u.v[at] = a;
        pc.u.v[at + pc.n] = 0.5 * (a + b + c);
        pc.u.v[at + 2 * pc.n] = 0.5 * (a - b + c);
        pc.u.v[at + 3 * pc.n] = c;
    }
}

#elif STAGE == 2
layout(push_constant) uniform Args {
    F32Buf x;   // images x C x IH x IW
    F32Buf v;   // 16 x C x T
    uint n;     // C * T
} pc;

void main() {
    const uint i = flat_index();  // c * T + t
    if (i >= pc.n) return;
    const uint t = i % T, c = i / T;
    const uint tx = t % TW, ty = (t / TW) % TH, img = t / (TW * TH);
    const int y0 = int(2 * ty) - PH, x0 = int(2 * tx) - PW;
    const uint base = (img * C + c) * (IH * IW);
    float d[16];
    for (int r = 0; r < 4; ++r) {
        const int yy = y0 + r;
        const bool row = yy >= 0 && yy < IH;
        for (int k = 0; k < 4; ++k) {
            const int xx = x0 + k;
            d[4 * r + k] = row && xx >= 0 && xx < IW ? pc.x.v[base + uint(yy * IW + xx)] : 0.0;
        }
    }
    float e[16];  // B^T d: rows
    for (uint k = 0; k < 4; ++k) {
        const float a = d[k], b = d[4 + k], c2 = d[8 + k], f = d[12 + k];
        e[k] = a - c2;
        e[4 + k] = b + c2;
        e[8 + k] = c2 - b;
        e[12 + k] = b - f;
    }
    for (uint r = 0; r < 4; ++r) {  // (B^T d) B: columns
        const float a = e[4 * r], b = e[4 * r + 1], c2 = e[4 * r + 2], f = e[4 * r + 3];
        const uint at = (4 * r) * pc.n + i;
        pc.v.v[at] = a - c2;
        pc.v.v[at + pc.n] = b + c2;
        pc.v.v[at + 2 * pc.n] = c2 - b;
        pc.v.v[at + 3 * pc.n] = b - f;
    }
}

#else
layout(push_constant) uniform Args {
    F32Buf p;   // 16 x M x T
    F32Buf b;   // M (the bias; any valid address without one)
    F32Buf y;   // images x M x OH x OW
    uint n;     // M * T
#if HAS_RES
    F32Buf r;   // a residual of y's layout, added before the activation
#endif
} pc;

void main() {
    const uint i = flat_index();  // m * T + t
    if (i >= pc.n) return;
    const uint t = i % T, m = i / T;
    const uint tx = t % TW, ty = (t / TW) % TH, img = t / (TW * TH);
    float q[16];
    for (uint k = 0; k < 16; ++k) q[k] = pc.p.v[k * pc.n + i];
    float s[8];  // A^T q: 2 x 4
    for (uint k = 0; k < 4; ++k) {
        s[k] = q[k] + q[4 + k] + q[8 + k];
        s[4 + k] = q[4 + k] - q[8 + k] - q[12 + k];
    }
#if HAS_BIAS
    const float bias = pc.b.v[m];
#else
    const float bias = 0.0;
#endif
    const uint oy0 = 2 * ty, ox0 = 2 * tx;
    const uint base = (img * M + m) * (OH * OW);
    for (uint r = 0; r < 2; ++r) {
        const uint oy = oy0 + r;
        if (oy >= OH) break;
        const float a = s[4 * r], b = s[4 * r + 1], c2 = s[4 * r + 2], f = s[4 * r + 3];
        const float pair[2] = float[2](a + b + c2, b - c2 - f);
        for (uint k = 0; k < 2; ++k) {
            const uint ox = ox0 + k;
            if (ox >= OW) break;
            const uint at = base + oy * OW + ox;
            float acc = pair[k] + bias;
#if HAS_RES
            acc += pc.r.v[at];
#endif
            pc.y.v[at] = epilogue(acc);
        }
    }
}
#endif
