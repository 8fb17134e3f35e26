#version 450
// Elementwise y = f(x) on float32. OP selects f; ALPHA/BETA arrive as push constants.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf y;
    uint n;
    float alpha;
    float beta;
} pc;

float apply(float v) {
#if OP == 0   // Relu
    return max(v, 0.0);
#elif OP == 1 // LeakyRelu
    return v >= 0.0 ? v : pc.alpha * v;
#elif OP == 2 // Sigmoid
    return 1.0 / (1.0 + exp(-v));
#elif OP == 3 // Tanh
    return tanh(v);
#elif OP == 4 // Clip(min=alpha, max=beta)
    return min(max(v, pc.alpha), pc.beta);
#elif OP == 5 // Identity / copy
    return v;
#else
#error "unknown OP"
#endif
}

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    pc.y.v[i] = apply(pc.x.v[i]);
}
