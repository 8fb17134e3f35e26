#version 450
// Finishes a split-K GEMV: y[n] = alpha * sum_s ws[s][n] + beta * c[n * sCn].
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf ws;
    F32Buf c;
    F32Buf y;
    uint N, splits, sCn;
    float alpha, beta;
} pc;

void main() {
    uint n = flat_index();
    if (n >= pc.N) return;
    float s = 0.0;
    for (uint i = 0; i < pc.splits; ++i) s += pc.ws.v[i * pc.N + n];
    float v = pc.alpha * s;
#if HAS_BIAS
    v += pc.beta * pc.c.v[n * pc.sCn];
#endif
    pc.y.v[n] = v;
}
