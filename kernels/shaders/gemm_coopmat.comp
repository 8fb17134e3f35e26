#version 450
// FP16 GEMM on cooperative matrices (VK_KHR_cooperative_matrix, subgroup scope):
// Y[z] = A[z] @ B[z] with A (M x K), B (K x N) and Y (M x N) row-major float16, accumulated in
// float32.
//
// A workgroup of WM x WN subgroups computes a BM x BN tile of Y; each subgroup owns a
// (BM / WM) x (BN / WN) block of it, TM x TN accumulator matrices of LM x LN (a shape the device
// lists for float16 x float16 -> float32). BK-deep slices of A and B are staged through shared
// memory, rows padded by 8 halves (16 bytes) so that a subgroup's row reads spread over all
// banks. While one slice is multiplied, the next PREFETCH slices (1 or 2) are on their way from
// global memory into registers. (NOTE: H200, driver 580: two shared buffers, one barrier per
// slice, ran at about half the speed of one buffer with the same tiles; 48 KiB of shared memory
// leaves no room for two buffers of the fastest tile anyway.)
//
// B_TRANS: B is given transposed (N x K row-major: a Linear's weight as stored), its slice staged
// as BN rows of BK halves and read as column-major B matrices; B_VEC then means K % 8 == 0.
// A_VEC / B_VEC: K (resp. N) is a multiple of 8 and the operands are 16-byte aligned, so tiles
// move in 16-byte vectors; otherwise element by element. Out-of-range rows and columns read as
// zero; EDGES = 0 (M, N, K multiples of the tile) leaves the checks out. Full output tiles go
// straight to memory with coopMatStore when N is a multiple of 8 (STORE_DIRECT); edge tiles pass
// through shared memory and are written element by element.
// SWIZZLE > 0 walks the tiles in column bands SWIZZLE tile-rows tall, so that workgroups
// running together share their A rows and B columns in the L2 cache.
// A fused product (vkpool.fusion): HAS_BIAS adds the float16 bias c[n] to the float32
// accumulators (LM copies of the tile's BN bias values are staged in the B slice, read back as an
// accumulator matrix), and ACT (epilogue.glsl) maps each accumulator element in place: the same
// function at every position, so the matrix's element order does not matter. Both before the
// one rounding to float16.
// SPLITK: workgroup z is a split of the reduction (one matrix, no batch): K from z * KCHUNK to
// (z + 1) * KCHUNK (KCHUNK a multiple of BK), and y points at the float32 workspace, where the
// split writes its partial sums (rows of N floats, split after split); gemm_reduce.comp adds them,
// the bias and the activation. STORE_DIRECT then means N % 4 == 0 (rows of floats on 16 bytes).
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"
#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#include "epilogue.glsl"

layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4Buf { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer U16Buf { uint16_t v[]; };
// rows of Y written by coopMatStore start on 16 bytes (N % 8 == 0)
layout(buffer_reference, std430, buffer_reference_align = 16) buffer F16Rows { float16_t v[]; };
// split-K's partial sums: rows of N floats (N % 4 == 0 for coopMatStore)
layout(buffer_reference, std430, buffer_reference_align = 16) buffer F32Rows { float v[]; };
#ifndef SPLITK
#define SPLITK 0
#endif

#define NSUB (WM * WN)
#define NT (NSUB * SG)
#define TM (BM / WM / LM)
#define TN (BN / WN / LN)
layout(local_size_x = NT) in;

layout(push_constant) uniform Args {
    uint64_t a;
    uint64_t b;
    uint64_t y;
    uint M, N, K;
    uint bA, bB;  // batch strides of A and B in elements (0: shared); Y's is M * N
    uint64_t c;   // the bias (HAS_BIAS)
} pc;

// the shared buffer in 16-byte units: the A slice (BM rows of BK halves), then the B slice (BK
// rows of BN halves)
#define AROW ((BK + 8) / 8)
#ifndef B_TRANS
#define B_TRANS 0
#endif
#define BROW ((BN + 8) / 8)
#define BTROW ((BK + 8) / 8)
#define A_SIZE (BM * AROW)
#if B_TRANS
#define B_SIZE (BN * BTROW)
#else
#define B_SIZE (BK * BROW)
#endif
shared uvec4 smem[A_SIZE + B_SIZE];

// per invocation and slice: 16-byte vectors of A and of B
#define A_LOADS (BM * BK / 8 / NT)
#define B_LOADS (BK * BN / 8 / NT)

uvec4 load8(uint64_t base, uint row, uint col, uint rows, uint cols, uint ld) {
    // eight halves of row `row` from column `col`, zero past the edges (element by element)
    uint h[8];
    [[unroll]] for (uint e = 0; e < 8; ++e) {
        uint c = col + e;
        h[e] = (row < rows && c < cols) ? uint(U16Buf(base + 2 * (uint64_t(row) * ld + c)).v[0]) : 0u;
    }
    return uvec4(h[0] | (h[1] << 16), h[2] | (h[3] << 16), h[4] | (h[5] << 16), h[6] | (h[7] << 16));
}

void fetch(out uvec4 a_regs[A_LOADS], out uvec4 b_regs[B_LOADS], uint64_t aBase, uint64_t bBase, uint row0,
           uint col0, uint k0) {
    const uint tid = gl_LocalInvocationIndex;
    [[unroll]] for (uint i = 0; i < A_LOADS; ++i) {
        uint v = tid + i * NT;
        uint r = row0 + v / (BK / 8), k = k0 + (v % (BK / 8)) * 8;
#if A_VEC && !EDGES
        a_regs[i] = U4Buf(aBase + 2 * (uint64_t(r) * pc.K + k)).v[0];
#elif A_VEC
        a_regs[i] = (r < pc.M && k < pc.K) ? U4Buf(aBase + 2 * (uint64_t(r) * pc.K + k)).v[0] : uvec4(0);
#else
        a_regs[i] = load8(aBase, r, k, pc.M, pc.K, pc.K);
#endif
    }
    [[unroll]] for (uint i = 0; i < B_LOADS; ++i) {
        uint v = tid + i * NT;
#if B_TRANS
        uint n = col0 + v / (BK / 8), k = k0 + (v % (BK / 8)) * 8;
#if B_VEC && !EDGES
        b_regs[i] = U4Buf(bBase + 2 * (uint64_t(n) * pc.K + k)).v[0];
#elif B_VEC
        b_regs[i] = (n < pc.N && k < pc.K) ? U4Buf(bBase + 2 * (uint64_t(n) * pc.K + k)).v[0] : uvec4(0);
#else
        b_regs[i] = load8(bBase, n, k, pc.N, pc.K, pc.K);
#endif
#else
        uint k = k0 + v / (BN / 8), n = col0 + (v % (BN / 8)) * 8;
#if B_VEC && !EDGES
        b_regs[i] = U4Buf(bBase + 2 * (uint64_t(k) * pc.N + n)).v[0];
#elif B_VEC
        b_regs[i] = (k < pc.K && n < pc.N) ? U4Buf(bBase + 2 * (uint64_t(k) * pc.N + n)).v[0] : uvec4(0);
#else
        b_regs[i] = load8(bBase, k, n, pc.K, pc.N, pc.N);
#endif
#endif
    }
}

void stash(uvec4 a_regs[A_LOADS], uvec4 b_regs[B_LOADS]) {
    const uint tid = gl_LocalInvocationIndex;
    [[unroll]] for (uint i = 0; i < A_LOADS; ++i) {
        uint v = tid + i * NT;
        smem[(v / (BK / 8)) * AROW + v % (BK / 8)] = a_regs[i];
    }
    [[unroll]] for (uint i = 0; i < B_LOADS; ++i) {
        uint v = tid + i * NT;
#if B_TRANS
        smem[A_SIZE + (v / (BK / 8)) * BTROW + v % (BK / 8)] = b_regs[i];
#else
        smem[A_SIZE + (v / (BN / 8)) * BROW + v % (BN / 8)] = b_regs[i];
#endif
    }
}

coopmat<float, gl_ScopeSubgroup, LM, LN, gl_MatrixUseAccumulator> acc[TM][TN];

void multiply(uint sm, uint sn) {
    [[unroll]] for (uint kk = 0; kk < BK; kk += LK) {
        coopmat<float16_t, gl_ScopeSubgroup, LM, LK, gl_MatrixUseA> ma[TM];
        [[unroll]] for (uint i = 0; i < TM; ++i)
            coopMatLoad(ma[i], smem, (sm + i * LM) * AROW + kk / 8, AROW, gl_CooperativeMatrixLayoutRowMajor);
        [[unroll]] for (uint j = 0; j < TN; ++j) {
            coopmat<float16_t, gl_ScopeSubgroup, LK, LN, gl_MatrixUseB> mb;
#if B_TRANS
            coopMatLoad(mb, smem, A_SIZE + (sn + j * LN) * BTROW + kk / 8, BTROW,
                        gl_CooperativeMatrixLayoutColumnMajor);
#else
            coopMatLoad(mb, smem, A_SIZE + kk * BROW + (sn + j * LN) / 8, BROW,
                        gl_CooperativeMatrixLayoutRowMajor);
#endif
            [[unroll]] for (uint i = 0; i < TM; ++i) acc[i][j] = coopMatMulAdd(ma[i], mb, acc[i][j]);
        }
    }
}

void main() {
    // tile coordinates, optionally swizzled into bands of SWIZZLE tile-rows
    uint tileM = gl_WorkGroupID.y, tileN = gl_WorkGroupID.x;
#if SWIZZLE > 0
    {
        const uint nx = gl_NumWorkGroups.x, ny = gl_NumWorkGroups.y;
        const uint id = gl_WorkGroupID.x + gl_WorkGroupID.y * nx;
        const uint band = id / (SWIZZLE * nx);
        const uint first = band * SWIZZLE;
        const uint height = min(ny - first, SWIZZLE);
        const uint within = id - band * SWIZZLE * nx;
        tileM = first + within % height;
        tileN = within / height;
    }
#endif
    const uint row0 = tileM * BM, col0 = tileN * BN;
    const uint z = gl_WorkGroupID.z;
#if SPLITK
    const uint kBegin = min(z * KCHUNK, pc.K);
    const uint kEnd = min(kBegin + KCHUNK, pc.K);
    const uint64_t aBase = pc.a, bBase = pc.b;
#else
    const uint kBegin = 0, kEnd = pc.K;
    const uint64_t aBase = pc.a + uint64_t(z) * pc.bA * 2;
    const uint64_t bBase = pc.b + uint64_t(z) * pc.bB * 2;
#endif
    const uint sg = gl_SubgroupID;
    const uint sm = (sg / WN) * (BM / WM), sn = (sg % WN) * (BN / WN);

    [[unroll]] for (uint i = 0; i < TM; ++i)
        [[unroll]] for (uint j = 0; j < TN; ++j)
            acc[i][j] = coopmat<float, gl_ScopeSubgroup, LM, LN, gl_MatrixUseAccumulator>(0.0);

    const uint slices = (kEnd - kBegin + BK - 1) / BK;
    uvec4 a0[A_LOADS], b0[B_LOADS];
    if (slices > 0) fetch(a0, b0, aBase, bBase, row0, col0, kBegin);
    // one shared buffer: fill it, barrier, multiply, barrier; the loads of the next PREFETCH
    // slices are in flight during each multiply
#if PREFETCH == 2
    uvec4 a1[A_LOADS], b1[B_LOADS];
    if (slices > 1) fetch(a1, b1, aBase, bBase, row0, col0, kBegin + BK);
    for (uint t = 0; t < slices; t += 2) {
        stash(a0, b0);
        barrier();
        if (t + 2 < slices) fetch(a0, b0, aBase, bBase, row0, col0, kBegin + (t + 2) * BK);
        multiply(sm, sn);
        barrier();
        if (t + 1 < slices) {
            stash(a1, b1);
            barrier();
            if (t + 3 < slices) fetch(a1, b1, aBase, bBase, row0, col0, kBegin + (t + 3) * BK);
            multiply(sm, sn);
            barrier();
        }
    }
#else
    for (uint t = 0; t < slices; ++t) {
        stash(a0, b0);
        barrier();
        if (t + 1 < slices) fetch(a0, b0, aBase, bBase, row0, col0, kBegin + (t + 1) * BK);
        multiply(sm, sn);
        barrier();
    }
#endif

    // epilogue: the shared buffer is free (every subgroup passed the last barrier)
#if SPLITK
    const uint64_t wsBase = pc.y + 4 * uint64_t(z) * pc.M * pc.N;
    const uint scratch = sg * (LM * LN / 4);
    const uint lane = gl_SubgroupInvocationID;
    [[unroll]] for (uint i = 0; i < TM; ++i) {
        const uint r = row0 + sm + i * LM;
        [[unroll]] for (uint j = 0; j < TN; ++j) {
            const uint c = col0 + sn + j * LN;
#if STORE_DIRECT
            if (r + LM <= pc.M && c + LN <= pc.N) {
                F32Rows rows = F32Rows(wsBase + 4 * (uint64_t(r) * pc.N + c));
                coopMatStore(acc[i][j], rows.v, 0, pc.N, gl_CooperativeMatrixLayoutRowMajor);
                continue;
            }
#endif
            if (r >= pc.M || c >= pc.N) continue;
            // edge tile: through this subgroup's corner of shared memory, then element by element
            coopMatStore(acc[i][j], smem, scratch, LN / 4, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint v = lane; v < LM * LN / 4; v += SG) {
                const uvec4 q = smem[scratch + v];
                const uint rr = r + (v * 4) / LN;
                [[unroll]] for (uint e = 0; e < 4; ++e) {
                    const uint cc = c + (v * 4) % LN + e;
                    if (rr < pc.M && cc < pc.N)
                        F32Buf(wsBase + 4 * (uint64_t(rr) * pc.N + cc)).v[0] = uintBitsToFloat(q[e]);
                }
            }
            subgroupBarrier();
        }
    }
#else
#if HAS_BIAS
    for (uint v = gl_LocalInvocationIndex; v < BN / 8; v += NT) {
        const uvec4 q = load8(pc.c, 0, col0 + v * 8, 1, pc.N, 0);
        [[unroll]] for (uint r = 0; r < LM; ++r) smem[A_SIZE + r * BROW + v] = q;
    }
    barrier();
#endif
    const uint64_t yBase = uint64_t(z) * pc.M * pc.N;
    const uint scratch = sg * (LM * LN / 8);
    const uint lane = gl_SubgroupInvocationID;
    [[unroll]] for (uint i = 0; i < TM; ++i) {
        const uint r = row0 + sm + i * LM;
        [[unroll]] for (uint j = 0; j < TN; ++j) {
            const uint c = col0 + sn + j * LN;
#if HAS_BIAS
            {
                coopmat<float16_t, gl_ScopeSubgroup, LM, LN, gl_MatrixUseAccumulator> bias_rows;
                coopMatLoad(bias_rows, smem, A_SIZE + (sn + j * LN) / 8, BROW, gl_CooperativeMatrixLayoutRowMajor);
                acc[i][j] += coopmat<float, gl_ScopeSubgroup, LM, LN, gl_MatrixUseAccumulator>(bias_rows);
            }
#endif
#if ACT != 0
            // NOTE: H200, driver 580 (bench.gemm_fp16 128x3072x768 with bias and GELU by erf):
            // 33-36 µs with this loop left rolled, 15.6 unrolled, 13.2 for the bias alone
            [[unroll]] for (int e = 0; e < acc[i][j].length(); ++e) acc[i][j][e] = epilogue(acc[i][j][e]);
#endif
            coopmat<float16_t, gl_ScopeSubgroup, LM, LN, gl_MatrixUseAccumulator> out_tile =
                coopmat<float16_t, gl_ScopeSubgroup, LM, LN, gl_MatrixUseAccumulator>(acc[i][j]);
#if STORE_DIRECT
            if (r + LM <= pc.M && c + LN <= pc.N) {
                F16Rows rows = F16Rows(pc.y + 2 * (yBase + uint64_t(r) * pc.N + c));
                coopMatStore(out_tile, rows.v, 0, pc.N, gl_CooperativeMatrixLayoutRowMajor);
                continue;
            }
#endif
            if (r >= pc.M || c >= pc.N) continue;
            // edge tile: through this subgroup's corner of shared memory, then element by element
            coopMatStore(out_tile, smem, scratch, LN / 8, gl_CooperativeMatrixLayoutRowMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint v = lane; v < LM * LN / 8; v += SG) {
                const uvec4 q = smem[scratch + v];
                const uint rr = r + (v * 8) / LN;
                [[unroll]] for (uint e = 0; e < 8; ++e) {
                    const uint cc = c + (v * 8) % LN + e;
                    if (rr < pc.M && cc < pc.N) {
                        const uint bits = (q[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
                        U16Buf(pc.y + 2 * (yBase + uint64_t(rr) * pc.N + cc)).v[0] = uint16_t(bits);
                    }
                }
            }
            subgroupBarrier();
        }
    }
#endif
}
