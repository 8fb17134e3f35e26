#version 450
// FP16 GEMM on workgroup-scope cooperative matrices (VK_NV_cooperative_matrix2's workgroup scope
// and flexible dimensions, used through the VK_KHR_cooperative_matrix instructions):
// Y[z] = A[z] @ B[z], A (M x K), B (K x N), Y (M x N) row-major float16, accumulated in float32.
//
// A workgroup of WG invocations (the count the driver lists for its workgroup-scope size class)
// owns one BM x BN accumulator of Y and walks K in BK-deep steps; the driver splits the
// matrices over its subgroups and picks the multiply instructions and the staging, which on
// Hopper can be the warpgroup MMA that subgroup-scope matrices cannot reach.
// STAGE = 0 loads each step's A and B blocks straight from memory; STAGE = 1 first copies them
// into shared memory in 16-byte vectors (rows padded by 8 halves) and loads from there.
// Only whole tiles: M % BM == N % BN == K % BK == 0, K and N multiples of 8, 16-byte aligned
// operands (the planner checks it). SWIZZLE > 0 walks tiles in bands of SWIZZLE tile-rows.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"

layout(local_size_x = WG) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer F16Rows { float16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4Rows { uvec4 v[]; };

layout(push_constant) uniform Args {
    uint64_t a;
    uint64_t b;
    uint64_t y;
    uint M, N, K;
    uint bA, bB;  // batch strides of A and B in elements (0: shared); Y's is M * N
} pc;

#define MatA coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA>
#define MatB coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB>
#define Acc coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>
#define Out coopmat<float16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>

#if STAGE
// halves per padded row of the staged A block (BK + 8) and B block (BN + 8)
#define AROW (BK + 8)
#define BROW (BN + 8)
shared uvec4 smem[(BM * AROW + BK * BROW) / 8];
#define A_VECS (BM * BK / 8)
#define B_VECS (BK * BN / 8)
#endif

void main() {
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
    const uint64_t aRows = pc.a + 2 * (uint64_t(z) * pc.bA + uint64_t(row0) * pc.K);
    const uint64_t bCols = pc.b + 2 * (uint64_t(z) * pc.bB + col0);

    Acc acc = Acc(0.0);
    for (uint k = 0; k < pc.K; k += BK) {
        MatA ma;
        MatB mb;
#if STAGE
        const uint tid = gl_LocalInvocationIndex;
        [[unroll]] for (uint v = tid; v < A_VECS; v += WG) {
            const uint r = v / (BK / 8), c = v % (BK / 8);
            smem[r * (AROW / 8) + c] = U4Rows(aRows + 2 * (uint64_t(r) * pc.K + k + c * 8)).v[0];
        }
        [[unroll]] for (uint v = tid; v < B_VECS; v += WG) {
            const uint r = v / (BN / 8), c = v % (BN / 8);
            smem[(BM * AROW) / 8 + r * (BROW / 8) + c] = U4Rows(bCols + 2 * (uint64_t(k + r) * pc.N + c * 8)).v[0];
        }
        barrier();
        coopMatLoad(ma, smem, 0, AROW / 8, gl_CooperativeMatrixLayoutRowMajor);
        coopMatLoad(mb, smem, (BM * AROW) / 8, BROW / 8, gl_CooperativeMatrixLayoutRowMajor);
        acc = coopMatMulAdd(ma, mb, acc);
        barrier();
#else
        coopMatLoad(ma, F16Rows(aRows + 2 * k).v, 0, pc.K, gl_CooperativeMatrixLayoutRowMajor);
        coopMatLoad(mb, F16Rows(bCols + 2 * uint64_t(k) * pc.N).v, 0, pc.N, gl_CooperativeMatrixLayoutRowMajor);
        acc = coopMatMulAdd(ma, mb, acc);
#endif
    }
    Out result = Out(acc);
    const uint64_t yTile = pc.y + 2 * (uint64_t(z) * pc.M * pc.N + uint64_t(row0) * pc.N + col0);
    coopMatStore(result, F16Rows(yTile).v, 0, pc.N, gl_CooperativeMatrixLayoutRowMajor);
}
