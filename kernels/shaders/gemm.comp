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
// With REGISTER_TILE (CPU-like devices, vkpool.kernel_variants) a workgroup is WG invocations
// with TM x TN outputs each in registers, no shared memory and no barrier; see below.
//
// With HAS_RES a residual tensor of Y's layout is added to each output before the activation
// (a residual block's sum folded into its convolution, vkpool.fusion); with SPLITS > 1 the
// reduction adds it.
//
// With CONV defined this is an implicit-GEMM convolution: A is the weight [G][Mg][K],
// B is the im2col of the input computed on the fly (K = Cg*KD*KH*KW rows, N = OD*OH*OW
// columns), z = image * G + group and the bias is per output channel (row). With FOLD as well
// (one group only) the images are columns too: N = images * OD*OH*OW, column n is output
// position n % (OD*OH*OW) of image n / (OD*OH*OW), and z is 0 (split over K, the partial
// products keep the M x N layout; gemm_reduce.comp's FOLD places the sums).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"
#if A_SHUFFLE
#extension GL_KHR_shader_subgroup_shuffle : require
#endif

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
#ifndef REGISTER_TILE
#define REGISTER_TILE 0
#endif
#if REGISTER_TILE
// The variant for CPU-like devices (lavapipe): no shared memory and no barrier (a barrier makes
// a CPU implementation switch between the invocations of a workgroup), one SIMD-wide workgroup
// of WG invocations, each accumulating TM rows x TN columns in registers; the columns of an
// invocation are WG apart, so a workgroup's loads of B are WG consecutive floats.
#ifndef WG
#define WG 8
#endif
#define TX WG
#define NT WG
#else
#define TX (BN / TN)
#define TY (BM / TM)
#define NT (TX * TY)
#endif
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
#if HAS_RES
    F32Buf r;  // the residual: added to each output after the bias, before the activation
#endif
} pc;

#if !REGISTER_TILE
// An operand whose tile is read from memory along K (A with A_KCONTIG, B without B_NCONTIG) is
// stored by consecutive invocations down a column of its stage: rows padded by 32 / BK floats put
// a warp's 32 stores (BK values of k by 32 / BK of m or n) in 32 different banks, where unpadded
// rows put them in 32 / BK banks.
#define KPAD (BK < 32 ? 32 / BK : 1)
#if A_KCONTIG
#define PAD_A KPAD
#else
#define PAD_A 0
#endif
#if B_NCONTIG
#define PAD_B 0
#else
#define PAD_B KPAD
#endif
#if VEC4
// Each invocation's TM rows (TN columns) are groups of 4 consecutive ones, TY * 4 (TX * 4) apart,
// read from the stages as vec4: a quarter of the shared-memory loads. Pads round up to a vec4.
#if TM % 4 != 0 || TN % 4 != 0
#error "VEC4 needs TM and TN multiples of 4"
#endif
shared vec4 As4[BK][(BM + PAD_A + 3) / 4];
shared vec4 Bs4[BK][(BN + PAD_B + 3) / 4];
#define OUT_ROW(i) (((ty + ((i) / 4) * TY) * 4) + (i) % 4)
#define OUT_COL(j) (((tx + ((j) / 4) * TX) * 4) + (j) % 4)
#else
shared float As[BK][BM + PAD_A];
shared float Bs[BK][BN + PAD_B];
#define OUT_ROW(i) (ty + (i) * TY)
#define OUT_COL(j) (tx + (j) * TX)
#endif
#endif
#if REGISTER_TILE
#define OUT_ROW(i) (ty + (i) * TY)
#define OUT_COL(j) (tx + (j) * TX)
#endif

#ifdef CONV
// Geometry (defines): G, CG (input channels per group), ID/IH/IW, OD/OH/OW, KD/KH/KW,
// SD/SH/SW strides, PD/PH/PW leading pads, DD/DH/DW dilations; spatial dims padded to 3.
#ifdef FOLD
#if REGISTER_TILE || G != 1
#error "FOLD is for the shared tiling of one group"
#endif
#define OSIZE (OD * OH * OW)
#endif
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

#if defined(CONV) && !REGISTER_TILE
// Every element of B an invocation loads lies in one column, col0 + tid % BN, at every stage (B's
// columns are contiguous, and a tile's invocations are a multiple of BN): that column's image and
// window origin are found once (set_column), and a load only places its row k in the window.
// NOTE: H200, driver 580 (docs/gpu/h200-conv-column-once.md), GPU ms against placing every
// element's column anew: ResNet-50 at batch 16 6.67 against 7.40, at batch 1 0.992 against
// 1.042, U-Net 1.403 against 1.45, MobileNetV2 0.474 against 0.520.
#if !B_NCONTIG || NT % BN != 0
#error "an implicit-GEMM tile reads B's columns contiguous, with invocations a multiple of BN"
#endif
uint colBase;       // the column's image in B
int colD, colH, colW;  // its window's origin (outside every row for a column past N)
void set_column(uint bBase, uint n) {
    uint base = bBase, p = n;
#ifdef FOLD
    base += (p / OSIZE) * (CG * ID * IH * IW);
    p %= OSIZE;
#endif
    uint ow = p % OW; uint u = p / OW;
    uint oh = u % OH; uint od = u / OH;
    colBase = base;
    colD = int(od * SD) - PD;
    colH = int(oh * SH) - PH;
    colW = n < pc.N ? int(ow * SW) - PW : -int(IW + KW * DW);
}
float load_b(uint k) {
    uint kw = k % KW; uint t = k / KW;
    uint kh = t % KH; t /= KH;
    uint kd = t % KD; uint ch = t / KD;
    int id = colD + int(kd * DD), ih = colH + int(kh * DH), iw = colW + int(kw * DW);
    if (uint(id) >= ID || uint(ih) >= IH || uint(iw) >= IW) return 0.0;
    return pc.b.v[colBase + ((ch * ID + uint(id)) * IH + uint(ih)) * IW + uint(iw)];
}
#endif

float fetch_b(uint e, uint k0, uint col0, uint bBase, uint kEnd) {
#if defined(CONV) && !REGISTER_TILE
    uint gk = k0 + b_k(e);
    return (e < BK * BN && gk < kEnd) ? load_b(gk) : 0.0;
#else
    uint gn = col0 + b_n(e), gk = k0 + b_k(e);
    if (e >= BK * BN || gn >= pc.N || gk >= kEnd) return 0.0;
    return pc.b.v[bBase + gk * pc.sBk + gn * pc.sBn];
#endif
}

void main() {
    const uint tid = gl_LocalInvocationIndex;
#if REGISTER_TILE
    const uint tx = tid;
    const uint ty = 0;
#define TY 1
#else
    const uint tx = tid % TX;
    const uint ty = tid / TX;
#endif
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

#if REGISTER_TILE
    // rows and columns past the edge read row or column 0 (always there) and are not written
    uint aRow[TM];
    for (uint i = 0; i < TM; ++i) {
        uint m = row0 + i;
        aRow[i] = aBase + (m < M ? m : 0) * pc.sAm;
    }
#ifdef CONV
    // each column's window origin once; the reduction index k = ((ch * KD + kd) * KH + kh) * KW + kw
    // advances by carries instead of a division per element
    int d0[TN], h0[TN], w0[TN];
    for (uint j = 0; j < TN; ++j) {
        uint n = col0 + tx + j * WG;
        uint ow = n % OW; uint u = n / OW;
        uint oh = u % OH; uint od = u / OH;
        d0[j] = int(od * SD) - PD;
        h0[j] = int(oh * SH) - PH;
        // a column past the edge gets an origin outside every row: it loads zeros
        w0[j] = n < N ? int(ow * SW) - PW : -int(IW + KW * DW);
    }
    uint kw = kBegin % KW; uint t = kBegin / KW;
    uint kh = t % KH; t /= KH;
    uint kd = t % KD; uint ch = t / KD;
#else
    uint bCol[TN];
    for (uint j = 0; j < TN; ++j) {
        uint n = col0 + tx + j * WG;
        bCol[j] = n < N ? n : 0;
    }
#endif
    // With A_SHUFFLE the workgroup is one subgroup: lane l loads A[m][k0 + l] of each row and
    // every lane takes step s's value from lane s, one load of A per WG steps of k (on lavapipe a
    // load costs a loop over the lanes, a shuffle a register move). Without, each step loads A.
#if A_SHUFFLE
    const uint STEP = WG;
#else
    const uint STEP = 1;
#endif
    for (uint k0 = kBegin; k0 < kEnd; k0 += STEP) {
#if A_SHUFFLE
        float ar[TM];
        for (uint i = 0; i < TM; ++i) ar[i] = k0 + tx < kEnd ? pc.a.v[aRow[i] + (k0 + tx) * pc.sAk] : 0.0;
#endif
        const uint steps = min(STEP, kEnd - k0);
        for (uint s = 0; s < steps; ++s) {
            const uint k = k0 + s;
            float bv[TN];
#ifdef CONV
            const uint chBase = bBase + ch * (ID * IH * IW);
            for (uint j = 0; j < TN; ++j) {
                int id = d0[j] + int(kd * DD), ih = h0[j] + int(kh * DH), iw = w0[j] + int(kw * DW);
                bool inside = uint(id) < ID && uint(ih) < IH && uint(iw) < IW;
                bv[j] = inside ? pc.b.v[chBase + (uint(id) * IH + uint(ih)) * IW + uint(iw)] : 0.0;
            }
#else
            for (uint j = 0; j < TN; ++j) bv[j] = pc.b.v[bBase + k * pc.sBk + bCol[j] * pc.sBn];
#endif
            for (uint i = 0; i < TM; ++i) {
#if A_SHUFFLE
                const float av = subgroupShuffle(ar[i], s);
#else
                const float av = pc.a.v[aRow[i] + k * pc.sAk];
#endif
                for (uint j = 0; j < TN; ++j) acc[i][j] = fma(av, bv[j], acc[i][j]);
            }
#ifdef CONV
            if (++kw == KW) {
                kw = 0;
                if (++kh == KH) {
                    kh = 0;
                    if (++kd == KD) { kd = 0; ++ch; }
                }
            }
#endif
        }
    }
#else
    // each stage's tile elements are read from memory into registers while the stage before
    // is multiplied out of shared memory, so the loads' latency overlaps the arithmetic
    float ra[LA], rb[LB];
#ifdef CONV
    set_column(bBase, col0 + tid % BN);
#endif
    for (uint u = 0; u < LA; ++u) ra[u] = fetch_a(tid + u * NT, kBegin, row0, aBase, kEnd);
    for (uint u = 0; u < LB; ++u) rb[u] = fetch_b(tid + u * NT, kBegin, col0, bBase, kEnd);
    for (uint k0 = kBegin; k0 < kEnd; k0 += BK) {
        for (uint u = 0; u < LA; ++u) {
            uint e = tid + u * NT;
#if VEC4
            if (e < BM * BK) As4[a_k(e)][a_m(e) / 4][a_m(e) % 4] = ra[u];
#else
            if (e < BM * BK) As[a_k(e)][a_m(e)] = ra[u];
#endif
        }
        for (uint u = 0; u < LB; ++u) {
            uint e = tid + u * NT;
#if VEC4
            if (e < BK * BN) Bs4[b_k(e)][b_n(e) / 4][b_n(e) % 4] = rb[u];
#else
            if (e < BK * BN) Bs[b_k(e)][b_n(e)] = rb[u];
#endif
        }
        barrier();
        if (k0 + BK < kEnd) {
            for (uint u = 0; u < LA; ++u) ra[u] = fetch_a(tid + u * NT, k0 + BK, row0, aBase, kEnd);
            for (uint u = 0; u < LB; ++u) rb[u] = fetch_b(tid + u * NT, k0 + BK, col0, bBase, kEnd);
        }
        for (uint kk = 0; kk < BK; ++kk) {
#if VEC4
            vec4 av[TM / 4], bv[TN / 4];
            for (uint i = 0; i < TM / 4; ++i) av[i] = As4[kk][ty + i * TY];
            for (uint j = 0; j < TN / 4; ++j) bv[j] = Bs4[kk][tx + j * TX];
            for (uint i = 0; i < TM; ++i)
                for (uint j = 0; j < TN; ++j) acc[i][j] = fma(av[i / 4][i % 4], bv[j / 4][j % 4], acc[i][j]);
#else
            float av[TM], bv[TN];
            for (uint i = 0; i < TM; ++i) av[i] = As[kk][ty + i * TY];
            for (uint j = 0; j < TN; ++j) bv[j] = Bs[kk][tx + j * TX];
            for (uint i = 0; i < TM; ++i)
                for (uint j = 0; j < TN; ++j) acc[i][j] = fma(av[i], bv[j], acc[i][j]);
#endif
        }
        barrier();
    }
#endif

#if SPLITS > 1
    // raw partial sums; gemm_reduce.comp applies alpha and the bias
    const uint yBase = (split * gl_NumWorkGroups.z / SPLITS + z) * M * N;
#else
    const uint yBase = z * M * N;
#endif
    for (uint i = 0; i < TM; ++i) {
        uint m = row0 + OUT_ROW(i);
        if (m >= M) continue;
        for (uint j = 0; j < TN; ++j) {
            uint n = col0 + OUT_COL(j);
            if (n >= N) continue;
#if SPLITS > 1
            pc.y.v[yBase + m * N + n] = acc[i][j];
            continue;
#endif
            float v = pc.alpha * acc[i][j];
#if HAS_BIAS
            v += pc.beta * pc.c.v[cBase + m * pc.sCm + n * pc.sCn];
#endif
#ifdef FOLD
            const uint yi = (n / OSIZE * M + m) * OSIZE + n % OSIZE;
#else
            const uint yi = yBase + m * N + n;
#endif
#if HAS_RES
            v += pc.r.v[yi];
#endif
            pc.y.v[yi] = epilogue(v);
        }
    }
}
