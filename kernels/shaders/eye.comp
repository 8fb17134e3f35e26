#version 450
// EyeLike: y[r, c] = 1 where c - r == k, else 0, for a rows x cols output of Y's element type.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    YBUF y;
    uint n;
    uint cols;
    int k;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    int r = int(i / pc.cols), c = int(i % pc.cols);
    pc.y.v[i] = YT(YCT(c - r == pc.k ? 1 : 0));
}
