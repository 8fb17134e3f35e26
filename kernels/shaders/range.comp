#version 450
// Range: y[i] = start + i * delta, computed in YCT (float for float16, 64-bit for int64).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    YBUF y;
    uint n;
    YCT start;
    YCT delta;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    pc.y.v[i] = YT(pc.start + YCT(i) * pc.delta);
}
