#version 450
// Attention for CPU-like devices (lavapipe): no shared memory and no barrier. A workgroup is one
// subgroup of WG invocations, each owning one query row of a (batch, query head): its scaled
// query and its output row stay in registers, with an online softmax (a running maximum and
// sum, rescaled once per block of KB keys), so scores never reach memory. Every feature of
// attention_tiled.comp (KV cache via kv_concat's present tensors, masks, causal, windows,
// nonpad lengths, softcap) with the same defines, plus WG, KB, DP and DVP (D and DV rounded up
// to a multiple of WG). With SHUFFLE (WG is the subgroup size) lane l loads element d0 + l of
// a key or value row and every lane takes the others' by subgroupShuffle: one load per WG
// elements, where on lavapipe a load is a loop over the lanes and a shuffle a register move.
// HALF / MASK_HALF / QKV_ROW: float16 tensors and packed Q/K/V as in attention.comp.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#if HALF
#include "elem_types.glsl"
#define TBUF F16Buf
#define TT float16_t
#else
#define TBUF F32Buf
#define TT float
#endif
#if MASK_HALF
#define MBUF F16Buf
#else
#define MBUF F32Buf
#endif
#if SHUFFLE
#extension GL_KHR_shader_subgroup_shuffle : require
#endif
layout(local_size_x = WG) in;

layout(push_constant) uniform Args {
    TBUF q;
    TBUF k;
    TBUF v;
    MBUF mask;     // float mask, or a U8 mask read through U8Buf
    I64Buf nonpad;
    TBUF y;
    float scale;
    float softcap;
} pc;

#include "attention_index.glsl"

void main() {
    const uint lane = gl_LocalInvocationID.x;
    const uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint row = gl_WorkGroupID.x * WG + lane;
    const uint i = min(row, S - 1);  // a lane past the last row repeats it and writes nothing
    const uint hk = h / (HQ / HKV);

    float qr[DP];
    for (uint d = 0; d < DP; ++d) qr[d] = d < D ? float(pc.q.v[q_index(b, h, i, d)]) * pc.scale : 0.0;
    float acc[DVP];
    for (uint d = 0; d < DVP; ++d) acc[d] = 0.0;
    float m = NEG_INF, l = 0.0;

    for (uint j0 = 0; j0 < T; j0 += KB) {
        float sc[KB];
        float bm = NEG_INF;
        for (uint u = 0; u < KB; ++u) {
            const uint j = min(j0 + u, T - 1);  // keys past the end score -inf below
            const uint kb = kv_index(b, hk, j, 0, D);
            float s = 0.0;
#if SHUFFLE
            for (uint d0 = 0; d0 < DP; d0 += WG) {
                const float kv = d0 + lane < D ? float(pc.k.v[kb + d0 + lane]) : 0.0;
                for (uint t = 0; t < WG; ++t) s = fma(qr[d0 + t], subgroupShuffle(kv, t), s);
            }
#else
            for (uint d = 0; d < D; ++d) s = fma(qr[d], float(pc.k.v[kb + d]), s);
#endif
#if SOFTCAP
            s = pc.softcap * tanh(s / pc.softcap);
#endif
            const float t = j0 + u < T ? s + bias(b, h, i, j) : NEG_INF;
            sc[u] = t;
            bm = max(bm, t);
        }
        // every lane runs the same steps (the shuffles need all of them): a row whose keys so
        // far are all masked adds zeros
        const float mn = max(m, bm);
        const bool none = mn == NEG_INF;
        const float corr = none ? 1.0 : exp(m - mn);
        m = mn;
        l *= corr;
        for (uint d = 0; d < DVP; ++d) acc[d] *= corr;
        for (uint u = 0; u < KB; ++u) {
            const float p = none ? 0.0 : exp(sc[u] - mn);
            l += p;
            const uint vb = kv_index(b, hk, min(j0 + u, T - 1), 0, DV);
#if SHUFFLE
            for (uint d0 = 0; d0 < DVP; d0 += WG) {
                const float vv = d0 + lane < DV ? float(pc.v.v[vb + d0 + lane]) : 0.0;
                for (uint t = 0; t < WG; ++t) acc[d0 + t] = fma(p, subgroupShuffle(vv, t), acc[d0 + t]);
            }
#else
            for (uint d = 0; d < DV; ++d) acc[d] = fma(p, float(pc.v.v[vb + d]), acc[d]);
#endif
        }
    }
    if (row >= S) return;
    const float inv = l > 0.0 ? 1.0 / l : 0.0;  // every key masked: zeros, as the reference gives
    for (uint d = 0; d < DV; ++d) pc.y.v[y_index(b, h, i, d)] = TT(acc[d] * inv);
}
