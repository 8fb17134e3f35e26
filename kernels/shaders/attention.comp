#version 450
// Attention (ONNX opset 23+): one workgroup per query row (b, h, i). Shapes are compile-time
// defines (one pipeline per node), so the push constants carry only pointers and two floats.
// Pass 1 scores s_j = softcap(scale * q.k_j) + bias_j into the workspace row; pass 2 the
// softmax in place (a row whose bias is all -inf gives zeros, as the reference does); pass 3
// y[d] = sum_j p_j v_j[d]. Layouts: Q3D: Q/Y are [B, S, H*D] (else [B, H, S, D]); KV3D: K/V are
// [B, T, Hkv*D] (else [B, Hkv, T, D]: also the layout of present_key/value).
// Mask bias: MASK_BOOL false -> -inf, else added; columns past MASK_LEN are masked; CAUSAL with
// offset (past length, or nonpad_kv_seqlen[b] - S); NONPAD masks j >= nonpad_kv_seqlen[b];
// WL/WR >= 0 bound the sliding window. QK_MODE (0..3, -1 none) picks the qk_matmul_output stage.
// HALF: Q, K, V and Y are float16 (widened as read, every step float32, Y rounded once);
// MASK_HALF: a float mask is float16.
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
layout(local_size_x = 64) in;

layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer RowBuf { float v[]; };

layout(push_constant) uniform Args {
    TBUF q;
    TBUF k;
    TBUF v;
    MBUF mask;     // float mask, or a U8 mask read through mask_u8
    I64Buf nonpad;
    RowBuf scores;   // workspace: one row of T floats per query row
    TBUF y;
    F32Buf qk_out;
    float scale;
    float softcap;
} pc;

shared float red[64];
#include "attention_index.glsl"

float reduce_max(float x, uint lane) {
    red[lane] = x;
    barrier();
    for (uint s = 32; s > 0; s >>= 1) {
        if (lane < s) red[lane] = max(red[lane], red[lane + s]);
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

float reduce_sum(float x, uint lane) {
    red[lane] = x;
    barrier();
    for (uint s = 32; s > 0; s >>= 1) {
        if (lane < s) red[lane] += red[lane + s];
        barrier();
    }
    float r = red[0];
    barrier();
    return r;
}

void main() {
    uint row = flat_group();
    if (row >= B * HQ * S) return;  // uniform over the workgroup
    uint lane = gl_LocalInvocationID.x;
    uint i = row % S, h = (row / S) % HQ, b = row / (S * HQ);
    uint hk = h / (HQ / HKV);
    uint base = row * T;

    float tmax = NEG_INF, bmax = NEG_INF;
    for (uint j = lane; j < T; j += 64) {
        float s = 0.0;
        for (uint d = 0; d < D; ++d) s += float(pc.q.v[q_index(b, h, i, d)]) * float(pc.k.v[kv_index(b, hk, j, d, D)]);
        s *= pc.scale;
#if SOFTCAP
        s = pc.softcap * tanh(s / pc.softcap);
#endif
        float bj = bias(b, h, i, j);
        float t = s + bj;
#if QK_MODE == 0 || QK_MODE == 1
        pc.qk_out.v[base + j] = s;
#elif QK_MODE == 2
        pc.qk_out.v[base + j] = t;
#endif
        pc.scores.v[base + j] = t;
        tmax = max(tmax, t);
        bmax = max(bmax, bj);
    }
    tmax = reduce_max(tmax, lane);
    bool all_masked = reduce_max(bmax, lane) == NEG_INF;
    float m = tmax == NEG_INF ? 0.0 : tmax;
    float sum = 0.0;
    for (uint j = lane; j < T; j += 64) sum += exp(pc.scores.v[base + j] - m);
    sum = reduce_sum(sum, lane);
    if (sum == 0.0) sum = 1.0;
    for (uint j = lane; j < T; j += 64) {
        float p = all_masked ? 0.0 : exp(pc.scores.v[base + j] - m) / sum;
        pc.scores.v[base + j] = p;
#if QK_MODE == 3
        pc.qk_out.v[base + j] = p;
#endif
    }
    memoryBarrierBuffer();
    barrier();
    for (uint d = lane; d < DV; d += 64) {
        float acc = 0.0;
        for (uint j = 0; j < T; ++j) acc += pc.scores.v[base + j] * float(pc.v.v[kv_index(b, hk, j, d, DV)]);
        pc.y.v[y_index(b, h, i, d)] = TT(acc);
    }
}
