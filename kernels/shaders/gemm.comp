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

// Element e of a stage's A tile (BM x BK) and B tile (BK x BN): consecutive invocations take
// consecutive addresses of the operand's contiguous dimension.
#if A_KCONTIG
uint a_k(uint e) { return e % BK; }
uint a_m(uint e) { return e / BK; }
#else
uint a_k(uint e) { return e / BM; }
uint a_m(uint e) { return e % BM; }
#endif
#if B_NCONTIG
uint b_k(uint e) { return e / BN; }
uint b_n(uint e) { return e % BN; }
#else
uint b_k(uint e) { return e % BK; }
uint b_n(uint e) { return e / BK; }
#endif
#define LA ((BM * BK + NT - 1) / NT)
#define LB ((BK * BN + NT - 1) / NT)

float fetch_a(uint e, uint k0, uint row0, uint aBase, uint kEnd) {
    uint gm = row0 + a_m(e), gk = k0 + a_k(e);
    return (e < BM * BK && gm < pc.M && gk < kEnd) ? pc.a.v[aBase + gm * pc.sAm + gk * pc.sAk] : 0.0;
}

float fetch_b(uint e, uint k0, uint col0, uint bBase, uint kEnd) {
    uint gn = col0 + b_n(e), gk = k0 + b_k(e);
    if (e >= BK * BN || gn >= pc.N || gk >= kEnd) return 0.0;
#ifdef CONV
    return load_b(bBase, gk, gn);
#else
    return pc.b.v[bBase + gk * pc.sBk + gn * pc.sBn];
#endif
}

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

    // each stage's tile elements are read from memory into registers while the stage before
    // is multiplied out of shared memory, so the loads' latency overlaps the arithmetic
    float ra[LA], rb[LB];
    for (uint u = 0; u < LA; ++u) ra[u] = fetch_a(tid + u * NT, kBegin, row0, aBase, kEnd);
    for (uint u = 0; u < LB; ++u) rb[u] = fetch_b(tid + u * NT, kBegin, col0, bBase, kEnd);
    for (uint k0 = kBegin; k0 < kEnd; k0 += BK) {
        for (uint u = 0; u < LA; ++u) {
            uint e = tid + u * NT;
            if (e < BM * BK) As[a_k(e)][a_m(e)] = ra[u];
        }
        for (uint u = 0; u < LB; ++u) {
            uint e = tid + u * NT;
            if (e < BK * BN) Bs[b_k(e)][b_n(e)] = rb[u];
        }
        barrier();
        if (k0 + BK < kEnd) {
            for (uint u = 0; u < LA; ++u) ra[u] = fetch_a(tid + u * NT, k0 + BK, row0, aBase, kEnd);
            for (uint u = 0; u < LB; ++u) rb[u] = fetch_b(tid + u * NT, k0 + BK, col0, bBase, kEnd);
        }
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
