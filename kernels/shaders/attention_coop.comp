#version 450
// Attention on cooperative matrices (float16 Q/K/V, float32 scores and sums), for key counts
// whose whole score rows fit shared memory: one workgroup of 128 invocations per (batch, query
// head, 16 query rows). Q's 16 rows and every key of the head are staged in shared memory;
// S = Q Kᵀ is 16 x 16 matrix products spread over the subgroups; each row's softmax (scale,
// softcap, mask and positions as attention.comp's, through attention_index.glsl) is computed
// once over the whole row in shared memory, its probabilities rounded to float16; then the
// values replace the keys in shared memory and O = P V is matrix products again, divided by the
// row's sum as it is written. No online rescaling: the row is whole. TP: T rounded up to 16.
// Defines as attention_tiled.comp's (HALF always; no KV cache), plus TP and VEC (D, DV and every
// row start multiples of 8 halves: Q/K/V staged as 16-byte vectors). NSPLITS (defined only then):
// q, k and v point into a packed Q/K/V product's float32 partial sums (NSPLITS slices of
// B * S * QKV_ROW values), added in split order with the product's bias (PBIAS: qb, kb, vb at
// each one's first column) and rounded to float16 as they are staged: the product's own
// reduction pass is not needed.
// V_APART: V has shared memory of its own and is staged with K, so that one wait on memory serves
// both (else V takes K's place after Q Kᵀ, a second wait). ROW_SHUFFLE: the invocations of a
// softmax row are lanes of one subgroup (subgroups of at least RT, whole), which combine their
// maxima and sums by shuffles instead of through shared memory and barriers.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#if ROW_SHUFFLE
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
#include "common.glsl"
#include "elem_types.glsl"
#define TBUF F16Buf
#define TT float16_t
#if MASK_HALF
#define MBUF F16Buf
#else
#define MBUF F32Buf
#endif
layout(local_size_x = 128) in;
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4Buf { uvec4 v[]; };

#ifdef NSPLITS
#define SRC F32Buf
#else
#define SRC TBUF
#endif
layout(push_constant) uniform Args {
    SRC q;
    SRC k;
    SRC v;
    MBUF mask;
    I64Buf nonpad;
    TBUF y;
    float scale;
    float softcap;
#ifdef NSPLITS
    F16Buf qb;
    F16Buf kb;
    F16Buf vb;
#endif
} pc;

#include "attention_index.glsl"

#ifndef V_APART
#define V_APART 0
#endif
#ifndef ROW_SHUFFLE
#define ROW_SHUFFLE 0
#endif
#define QB 16
#define NT 128
#define DKV (D > DV ? D : DV)
#define SW (TP > DV ? TP : DV)   // a row of the scores, later of the output
#define RT 8                      // invocations per row in the softmax
shared uvec4 Qs[QB * D / 8];
#if V_APART
shared uvec4 KVs[TP * D / 8];
shared uvec4 Vs[TP * DV / 8];
#define VS Vs
#else
shared uvec4 KVs[TP * DKV / 8];
#define VS KVs
#endif
shared float Ss[QB * SW];
shared float16_t Ps[QB * TP];
#if !ROW_SHUFFLE
shared float red[QB][RT];
#endif
shared float linv[QB];

#ifdef NSPLITS
// eight values of a packed row from the partial sums, plus the bias, as float16
void stage(F32Buf src, F16Buf bias, uint row_index, uint d8, out uvec4 dst) {
    const uint at = row_index / 4 + 2 * d8;
    vec4 lo = vec4(0.0), hi = vec4(0.0);
    [[unroll]] for (uint s = 0; s < NSPLITS; ++s) {
        lo += V4Buf(src).v[s * (B * S * QKV_ROW / 4) + at];
        hi += V4Buf(src).v[s * (B * S * QKV_ROW / 4) + at + 1];
    }
#if PBIAS
    const uvec4 c = U4Buf(bias).v[(row_index % QKV_ROW) / 8 + d8];
    lo += vec4(unpackHalf2x16(c.x), unpackHalf2x16(c.y));
    hi += vec4(unpackHalf2x16(c.z), unpackHalf2x16(c.w));
#endif
    dst = uvec4(packHalf2x16(lo.xy), packHalf2x16(lo.zw), packHalf2x16(hi.xy), packHalf2x16(hi.zw));
}
#define STAGE(which, bias, index, d8, dst) stage(which, bias, index, d8, dst)
#else
void stage(TBUF src, uint row_index, uint d8, out uvec4 dst) {
    dst = U4Buf(src).v[row_index / 8 + d8];
}
#define STAGE(which, bias, index, d8, dst) stage(which, index, d8, dst)
#endif

void main() {
    const uint id = gl_LocalInvocationIndex;
    const uint i0 = gl_WorkGroupID.x * QB;
    const uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint hk = h / (HQ / HKV);
    const uint sg = gl_SubgroupID, nsg = gl_NumSubgroups;

    [[unroll]] for (uint e = id; e < QB * D / 8; e += NT) {
        const uint rr = e / (D / 8), d8 = e % (D / 8);
        if (i0 + rr < S) STAGE(pc.q, pc.qb, q_index(b, h, i0 + rr, 0), d8, Qs[e]);
        else Qs[e] = uvec4(0);
    }
    [[unroll]] for (uint e = id; e < TP * D / 8; e += NT) {  // every load in flight together
        const uint jj = e / (D / 8), d8 = e % (D / 8);
        if (jj < T) STAGE(pc.k, pc.kb, kv_index(b, hk, jj, 0, D), d8, KVs[e]);
        else KVs[e] = uvec4(0);
    }
#if V_APART
    [[unroll]] for (uint e = id; e < TP * DV / 8; e += NT) {
        const uint jj = e / (DV / 8), d8 = e % (DV / 8);
        if (jj < T) STAGE(pc.v, pc.vb, kv_index(b, hk, jj, 0, DV), d8, Vs[e]);
        else Vs[e] = uvec4(0);
    }
#endif
    barrier();

    // S = Q Kᵀ, a 16 x 16 tile of keys per subgroup at a time: B[d][j] = K[j][d], column-major
    for (uint kt = sg; kt < TP / 16; kt += nsg) {
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
            coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
        [[unroll]] for (uint d0 = 0; d0 < D; d0 += 16) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
            coopMatLoad(ma, Qs, d0 / 8, D / 8, gl_CooperativeMatrixLayoutRowMajor);
            coopMatLoad(mb, KVs, (kt * 16 * D + d0) / 8, D / 8, gl_CooperativeMatrixLayoutColumnMajor);
            acc = coopMatMulAdd(ma, mb, acc);
        }
        coopMatStore(acc, Ss, kt * 16, SW, gl_CooperativeMatrixLayoutRowMajor);
    }
    barrier();  // every score written (and every key read: the values may take their place)

#if !V_APART
    [[unroll]] for (uint e = id; e < TP * DV / 8; e += NT) {
        const uint jj = e / (DV / 8), d8 = e % (DV / 8);
        if (jj < T) STAGE(pc.v, pc.vb, kv_index(b, hk, jj, 0, DV), d8, KVs[e]);
        else KVs[e] = uvec4(0);
    }
#endif
    {
#if ROW_SHUFFLE
        // RT consecutive lanes of a subgroup per row
        const uint lane = gl_SubgroupInvocationID;
        const uint r = sg * (gl_SubgroupSize / RT) + lane / RT, c = lane % RT, i = i0 + r;
#else
        const uint r = id / RT, c = id % RT, i = i0 + r;
#endif
        float tmax = NEG_INF;
        [[unroll]] for (uint j = c; j < TP; j += RT) {
            float t = NEG_INF;
            if (j < T && i < S) {
                float x = Ss[r * SW + j] * pc.scale;
#if SOFTCAP
                x = pc.softcap * tanh(x / pc.softcap);
#endif
                t = x + bias(b, h, i, j);
            }
            Ss[r * SW + j] = t;
            tmax = max(tmax, t);
        }
#if ROW_SHUFFLE
        [[unroll]] for (uint w = RT / 2; w > 0; w /= 2) tmax = max(tmax, subgroupShuffleXor(tmax, w));
#else
        red[r][c] = tmax;
        barrier();
        tmax = NEG_INF;
        [[unroll]] for (uint w = 0; w < RT; ++w) tmax = max(tmax, red[r][w]);
#endif
        // a row masked whole has probabilities 0 and output 0, never exp(nan)
        const float base = tmax == NEG_INF ? 0.0 : tmax;
        float psum = 0.0;
        [[unroll]] for (uint j = c; j < TP; j += RT) {
            const float t = Ss[r * SW + j];
            const float p = t == NEG_INF ? 0.0 : exp(t - base);
            Ps[r * TP + j] = float16_t(p);
            psum += p;
        }
#if ROW_SHUFFLE
        [[unroll]] for (uint w = RT / 2; w > 0; w /= 2) psum += subgroupShuffleXor(psum, w);
        if (c == 0) linv[r] = psum > 0.0 ? 1.0 / psum : 0.0;
#else
        barrier();  // red's maxima read by every lane of the row
        red[r][c] = psum;
        barrier();
        if (c == 0) {
            psum = 0.0;
            [[unroll]] for (uint w = 0; w < RT; ++w) psum += red[r][w];
            linv[r] = psum > 0.0 ? 1.0 / psum : 0.0;
        }
#endif
    }
    barrier();  // P complete, the values staged, the scores no longer read

    // O = P V, a 16 x 16 tile of output columns per subgroup at a time, over the scores' memory
    for (uint ot = sg; ot < DV / 16; ot += nsg) {
        coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc =
            coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
        for (uint kt = 0; kt < TP / 16; ++kt) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
            coopMatLoad(ma, Ps, kt * 16, TP, gl_CooperativeMatrixLayoutRowMajor);
            coopMatLoad(mb, VS, (kt * 16 * DV + ot * 16) / 8, DV / 8, gl_CooperativeMatrixLayoutRowMajor);
            acc = coopMatMulAdd(ma, mb, acc);
        }
        coopMatStore(acc, Ss, ot * 16, SW, gl_CooperativeMatrixLayoutRowMajor);
    }
    barrier();

    for (uint e = id; e < QB * DV; e += NT) {
        const uint r = e / DV, d = e % DV;
        if (i0 + r < S) pc.y.v[y_index(b, h, i0 + r, d)] = TT(Ss[r * SW + d] * linv[r]);
    }
}
