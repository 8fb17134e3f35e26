#version 450
// FP16 GEMM without cooperative matrices: Y[z] = A[z] @ B[z] with A (M x K), B (K x N) and Y
// (M x N) row-major float16, computed in float32; B_TRANS: B is given transposed (N x K
// row-major). Only 16-bit storage is needed (no shaderFloat16): halves are widened on load and
// narrowed on store.
//
// The tiling of gemm.comp: a workgroup computes a BM x BN tile of Y with TM x TN outputs per
// invocation, staging BK-deep slices of A and B through shared memory as float32.
// A fused product (vkpool.fusion) adds a float16 bias c[n] (HAS_BIAS) and applies ACT
// (epilogue.glsl) to the float32 sum before its one rounding to float16.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef B_TRANS
#define B_TRANS 0
#endif
#include "epilogue.glsl"

#define TX (BN / TN)
#define TY (BM / TM)
#define NT (TX * TY)
layout(local_size_x = NT) in;

layout(push_constant) uniform Args {
    F16Buf a;
    F16Buf b;
    F16Buf y;
    uint M, N, K;
    uint bA, bB;  // batch strides of A and B in elements (0: shared); Y's is M * N
    F16Buf c;     // the bias (HAS_BIAS)
} pc;

shared float As[BK][BM];
shared float Bs[BK][BN];

void main() {
    const uint tid = gl_LocalInvocationIndex;
    const uint tx = tid % TX, ty = tid / TX;
    const uint row0 = gl_WorkGroupID.y * BM, col0 = gl_WorkGroupID.x * BN;
    const uint z = gl_WorkGroupID.z;
    const uint aBase = z * pc.bA, bBase = z * pc.bB;
    const uint M = pc.M, N = pc.N, K = pc.K;

    float acc[TM][TN];
    for (uint i = 0; i < TM; ++i)
        for (uint j = 0; j < TN; ++j) acc[i][j] = 0.0;

    for (uint k0 = 0; k0 < K; k0 += BK) {
        for (uint e = tid; e < BM * BK; e += NT) {
            uint kk = e % BK, mm = e / BK;  // consecutive invocations read along K
            uint gm = row0 + mm, gk = k0 + kk;
            As[kk][mm] = (gm < M && gk < K) ? float(pc.a.v[aBase + gm * K + gk]) : 0.0;
        }
        for (uint e = tid; e < BK * BN; e += NT) {
#if B_TRANS
            uint kk = e % BK, nn = e / BK;  // B stored N x K: consecutive invocations read along K
            uint gn = col0 + nn, gk = k0 + kk;
            Bs[kk][nn] = (gn < N && gk < K) ? float(pc.b.v[bBase + gn * K + gk]) : 0.0;
#else
            uint nn = e % BN, kk = e / BN;  // consecutive invocations read along N
            uint gn = col0 + nn, gk = k0 + kk;
            Bs[kk][nn] = (gn < N && gk < K) ? float(pc.b.v[bBase + gk * N + gn]) : 0.0;
#endif
        }
        barrier();
        for (uint kk = 0; kk < BK; ++kk) {
            float av[TM], bv[TN];
            for (uint i = 0; i < TM; ++i) av[i] = As[kk][ty + i * TY];
            for (uint j = 0; j < TN; ++j) bv[j] = Bs[kk][tx + j * TX];
            for (uint i = 0; i < TM; ++i)
                for (uint j = 0; j < TN; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
        }
        barrier();
    }

    const uint yBase = z * M * N;
    for (uint i = 0; i < TM; ++i) {
        uint m = row0 + ty + i * TY;
        if (m >= M) continue;
        for (uint j = 0; j < TN; ++j) {
            uint n = col0 + tx + j * TX;
            if (n >= N) continue;
            float v = acc[i][j];
#if HAS_BIAS
            v += float(pc.c.v[n]);
#endif
            pc.y.v[yBase + m * N + n] = float16_t(epilogue(v));
        }
    }
}
