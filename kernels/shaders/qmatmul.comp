#version 450
// MatMulInteger (MODE 0: int32 y = (a - a_zero) (b - b_zero)) and QLinearMatMul (MODE 1: y =
// clamp(roundEven(that * a_scale * b_scale / y_scale) + y_zero, QMIN, QMAX)), per-tensor scales
// and zero points, one output element per invocation. a [batch?, M, K], b [batch?, K, N]; an
// operand without the batch (A_BATCH/B_BATCH 0) is shared. S* is the scales' type; with
// HALF_SCALES the multiplier is rounded to float16 after each operation, as it is computed in
// the scales' type. A*/B*/Y* are the element types.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    ABUF a;
    BBUF b;
    ABUF a_zero;   // a when absent
    BBUF b_zero;   // b when absent
    SBUF a_scale;  // a when MODE 0
    SBUF b_scale;
    SBUF y_scale;
    YBUF y_zero;   // y when absent
    YBUF y;
    uint n;
    uint M;
    uint K;
    uint N;
    uint has_a_zero;
    uint has_b_zero;
    uint has_y_zero;
} pc;

float to_half(float v) { return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x; }

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint col = i % pc.N, t = i / pc.N;
    uint row = t % pc.M, batch = t / pc.M;
    uint a0 = (A_BATCH != 0 ? batch * pc.M * pc.K : 0u) + row * pc.K;
    uint b0 = (B_BATCH != 0 ? batch * pc.K * pc.N : 0u) + col;
    int za = pc.has_a_zero != 0u ? int(ACT(pc.a_zero.v[0])) : 0;
    int zb = pc.has_b_zero != 0u ? int(BCT(pc.b_zero.v[0])) : 0;
    int acc = 0;
    for (uint k = 0; k < pc.K; ++k) {
        acc += (int(ACT(pc.a.v[a0 + k])) - za) * (int(BCT(pc.b.v[b0 + k * pc.N])) - zb);
    }
#if MODE == 0
    pc.y.v[i] = YT(acc);
#else
    float scale = float(pc.a_scale.v[0]) * float(pc.b_scale.v[0]);
#if HALF_SCALES
    scale = to_half(div_rn(to_half(scale), float(pc.y_scale.v[0])));
#else
    scale = div_rn(scale, float(pc.y_scale.v[0]));
#endif
    float zero = pc.has_y_zero != 0u ? float(YCT(pc.y_zero.v[0])) : 0.0;
    pc.y.v[i] = YT(YCT(clamp(roundEven(float(acc) * scale) + zero, QMIN, QMAX)));
#endif
}
