#version 450
// SwiGLU: y = a * sigmoid(alpha * a) * b, elementwise on float32.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;

layout(push_constant) uniform Args {
    F32Buf a;
    F32Buf b;
    F32Buf y;
    uint n;
    float alpha;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    float a = pc.a.v[i];
    pc.y.v[i] = a / (1.0 + exp(-pc.alpha * a)) * pc.b.v[i];
}
