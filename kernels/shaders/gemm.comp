#version 450
// Tiled shared-memory GEMM: Y[z] = alpha * op(A)[z] @ op(B)[z] + beta * C[z].
// Each workgroup computes a BM x BN tile of Y with TM x TN outputs per invocation, staging
// BK-deep slices of A and B through shared memory. Operands are addressed by element
// strides, so transposed operands and broadcast batches need no copy. A_KCONTIG / B_NCONTIG
// pick the tile-load mapping in which consecutive invocations read consecutive addresses.
//
// With SPLITS > 1 the K range is split over workgroups (z = batch * SPLITS + split) and Y is
// a workspace of SPLITS raw partial products, summed by gemm_reduce.comp.
//
// With CONV defined this is an implicit-GEMM convolution: A is the weight [G][Mg][K],
// B is the im2col of the input computed on the fly (K = Cg*KD*KH*KW rows, N = OD*OH*OW
// columns), z = image * G + group and the bias is per output channel (row).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"

#ifndef BM
#define BM 64
#endif
#ifndef BN
#define BN 64
#endif
#ifndef BK
#define BK 16
#endif
#ifndef TM
#define TM 4
#endif
#ifndef TN
#define TN 4
#endif
#define TX (BN / TN)
#define TY (BM / TM)
#define NT (TX * TY)
layout(local_size_x = NT) in;

layout(push_constant) uniform Args {
    F32Buf a;
    F32Buf b;
    F32Buf c;
    F32Buf y;
    uint M, N, K;
    uint sAm, sAk, sBk, sBn, sCm, sCn;
    uint bA, bB, bC;  // batch strides of A, B, C (elements); Y's is M * N
    float alpha, beta;
} pc;

shared float As[BK][BM];
shared float Bs[BK][BN];

#ifdef CONV
// Geometry (defines): G, CG (input channels per group), ID/IH/IW, OD/OH/OW, KD/KH/KW,
// SD/SH/SW strides, PD/PH/PW leading pads, DD/DH/DW dilations; spatial dims padded to 3.
float load_b(uint base, uint k, uint n) {
    uint kw = k % KW; uint t = k / KW;
    uint kh = t % KH; t /= KH;
    uint kd = t % KD; uint ch = t / KD;
    uint ow = n % OW; uint u = n / OW;
    uint oh = u % OH; uint od = u / OH;
    int id = int(od * SD + kd * DD) - PD;
    int ih = int(oh * SH + kh * DH) - PH;
    int iw = int(ow * SW + kw * DW) - PW;
    if (id < 0 || id >= ID || ih < 0 || ih >= IH || iw < 0 || iw >= IW) return 0.0;
    return pc.b.v[base + ((ch * ID + uint(id)) * IH + uint(ih)) * IW + uint(iw)];
}
#endif

void main() {
    const uint tid = gl_LocalInvocationIndex;
    const uint tx = tid % TX;
    const uint ty = tid / TX;
    const uint row0 = gl_WorkGroupID.y * BM;
    const uint col0 = gl_WorkGroupID.x * BN;
#if SPLITS > 1
    // split-K: z = batch * SPLITS + split; each split sums KCHUNK of K into the workspace
    const uint z = gl_WorkGroupID.z / SPLITS;
    const uint split = gl_WorkGroupID.z % SPLITS;
    const uint kBegin = split * KCHUNK;
    const uint kEnd = min(pc.K, kBegin + KCHUNK);
#else
    const uint z = gl_WorkGroupID.z;
    const uint kBegin = 0;
    const uint kEnd = pc.K;
#endif
#ifdef CONV
    const uint g = z % G;
    const uint aBase = g * pc.bA;
    const uint bBase = (z / G) * (G * CG * ID * IH * IW) + g * pc.bB;
    const uint cBase = g * pc.bC;
#else
    const uint aBase = z * pc.bA;
    const uint bBase = z * pc.bB;
    const uint cBase = z * pc.bC;
#endif
    const uint M = pc.M, N = pc.N;

    float acc[TM][TN];
    for (uint i = 0; i < TM; ++i)
        for (uint j = 0; j < TN; ++j) acc[i][j] = 0.0;

    for (uint k0 = kBegin; k0 < kEnd; k0 += BK) {
        for (uint e = tid; e < BM * BK; e += NT) {
#if A_KCONTIG
            uint kk = e % BK, mm = e / BK;
#else
            uint mm = e % BM, kk = e / BM;
#endif
            uint gm = row0 + mm, gk = k0 + kk;
            As[kk][mm] = (gm < M && gk < kEnd) ? pc.a.v[aBase + gm * pc.sAm + gk * pc.sAk] : 0.0;
        }
        for (uint e = tid; e < BK * BN; e += NT) {
#if B_NCONTIG
            uint nn = e % BN, kk = e / BN;
#else
            uint kk = e % BK, nn = e / BK;
#endif
            uint gn = col0 + nn, gk = k0 + kk;
#ifdef CONV
            Bs[kk][nn] = (gn < N && gk < kEnd) ? load_b(bBase, gk, gn) : 0.0;
#else
            Bs[kk][nn] = (gn < N && gk < kEnd) ? pc.b.v[bBase + gk * pc.sBk + gn * pc.sBn] : 0.0;
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

#if SPLITS > 1
    // raw partial sums; gemm_reduce.comp applies alpha and the bias
    const uint yBase = (split * gl_NumWorkGroups.z / SPLITS + z) * M * N;
#else
    const uint yBase = z * M * N;
#endif
    for (uint i = 0; i < TM; ++i) {
        uint m = row0 + ty + i * TY;
        if (m >= M) continue;
        for (uint j = 0; j < TN; ++j) {
            uint n = col0 + tx + j * TX;
            if (n >= N) continue;
#if SPLITS > 1
            pc.y.v[yBase + m * N + n] = acc[i][j];
            continue;
#endif
            float v = pc.alpha * acc[i][j];
#if HAS_BIAS
            v += pc.beta * pc.c.v[cBase + m * pc.sCm + n * pc.sCn];
#endif
            v = epilogue(v);
            pc.y.v[yBase + m * N + n] = v;
        }
    }
}
