#version 450
// Attention, tiled: one workgroup per (batch, query head, QB = 16 query rows). Keys and values
// pass through shared memory KB at a time; each row keeps a running maximum and sum (online
// softmax), so scores never leave the workgroup and K and V are read once per 16 rows instead
// of once per row. Every feature of attention.comp but the qk_matmul_output stage (KV cache
// via kv_concat's present tensors, masks, causal, windows, nonpad lengths, softcap); the same
// defines, plus KB (keys per tile, a multiple of 16). 256 invocations: row r = id / 16 owns
// lanes c = id % 16, which score keys c, c + 16, ... of a tile and accumulate output columns
// c, c + 16, ... of that row. HALF / MASK_HALF: float16 tensors as in attention.comp.
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
layout(local_size_x = 256) in;

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

#define QB 16
#define SC (KB / 16)                 // scores per invocation per tile
#define OC ((DV + 15) / 16)          // output columns per invocation
shared float Qs[QB][D + 1];
shared float Ks[KB][D + 1];          // padded: lanes of a row read 16 different keys at once
shared float Vs[KB][DV];
shared float Ps[QB][KB];
shared float red[QB][16];

void main() {
    const uint id = gl_LocalInvocationIndex;
    const uint r = id / 16, c = id % 16;
    const uint i0 = gl_WorkGroupID.x * QB;
    const uint h = gl_WorkGroupID.y, b = gl_WorkGroupID.z;
    const uint hk = h / (HQ / HKV);
    const uint i = i0 + r;

    for (uint e = id; e < QB * D; e += 256) {
        uint rr = e / D, d = e % D;
        Qs[rr][d] = i0 + rr < S ? float(pc.q.v[q_index(b, h, i0 + rr, d)]) : 0.0;
    }
    float m = NEG_INF, l = 0.0;
    float acc[OC];
    for (uint u = 0; u < OC; ++u) acc[u] = 0.0;

    for (uint j0 = 0; j0 < T; j0 += KB) {
        barrier();  // the previous tile's Ks, Vs, Ps and red are consumed (Qs written, first time)
        for (uint e = id; e < KB * D; e += 256) {
            uint jj = e / D, d = e % D;
            Ks[jj][d] = j0 + jj < T ? float(pc.k.v[kv_index(b, hk, j0 + jj, d, D)]) : 0.0;
        }
        for (uint e = id; e < KB * DV; e += 256) {
            uint jj = e / DV, d = e % DV;
            Vs[jj][d] = j0 + jj < T ? float(pc.v.v[kv_index(b, hk, j0 + jj, d, DV)]) : 0.0;
        }
        barrier();
        // the SC dot products of this lane together: each Q element read once from shared
        // memory for all of them (each dot still sums over d in order)
        float dots[SC];
        for (uint u = 0; u < SC; ++u) dots[u] = 0.0;
        for (uint d = 0; d < D; ++d) {
            const float qd = Qs[r][d];
            for (uint u = 0; u < SC; ++u) dots[u] = fma(qd, Ks[c + 16 * u][d], dots[u]);
        }
        float s[SC];
        float tmax = NEG_INF;
        for (uint u = 0; u < SC; ++u) {
            uint jj = c + 16 * u, j = j0 + jj;
            float t = NEG_INF;
            if (j < T && i < S) {
                float x = dots[u] * pc.scale;
#if SOFTCAP
                x = pc.softcap * tanh(x / pc.softcap);
#endif
                t = x + bias(b, h, i, j);
            }
            s[u] = t;
            tmax = max(tmax, t);
        }
        red[r][c] = tmax;
        barrier();
        for (uint w = 0; w < 16; ++w) tmax = max(tmax, red[r][w]);
        float mnew = max(m, tmax);
        // a row masked so far keeps m = -inf: its probabilities are 0, never exp(nan)
        float base = mnew == NEG_INF ? 0.0 : mnew;
        float psum = 0.0;
        for (uint u = 0; u < SC; ++u) {
            float p = s[u] == NEG_INF ? 0.0 : exp(s[u] - base);
            Ps[r][c + 16 * u] = p;
            psum += p;
        }
        barrier();  // every lane read red's maxima; Ps is complete
        red[r][c] = psum;
        barrier();
        psum = 0.0;
        for (uint w = 0; w < 16; ++w) psum += red[r][w];
        float corr = m == NEG_INF ? 0.0 : exp(m - base);
        l = l * corr + psum;
        m = mnew;
        // each probability read once for the lane's OC columns (each column sums over keys in order)
        for (uint u = 0; u < OC; ++u) acc[u] *= corr;
        for (uint jj = 0; jj < KB; ++jj) {
            const float p = Ps[r][jj];
            for (uint u = 0; u < OC; ++u) {
                const uint d = c + 16 * u;
                if (d < DV) acc[u] = fma(p, Vs[jj][d], acc[u]);
            }
        }
    }
    if (i >= S) return;
    for (uint u = 0; u < OC; ++u) {
        uint d = c + 16 * u;
        if (d < DV) pc.y.v[y_index(b, h, i, d)] = TT(l > 0.0 ? acc[u] / l : 0.0);
    }
}
