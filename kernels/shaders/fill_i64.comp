#version 450
// Writes one int64 known when the command buffer is recorded (Size of a static shape).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 1) in;

layout(push_constant) uniform Args {
    I64Buf y;
    int64_t value;
} pc;

void main() {
    pc.y.v[0] = pc.value;
}
