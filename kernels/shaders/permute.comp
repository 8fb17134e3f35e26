#version 450
// Strided gather: y[e] = x[sum_d coord_d(e) * stride[d]] for y of shape `shape` (rank <= 6).
// Any transpose of any reshape of x (DepthToSpace, SpaceToDepth, ...) is one such copy.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    TBUF y;
    uint n;
    uint rank;
    uint shape[6];
    uint stride[6];
} pc;

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
    uint rem = e, off = 0;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        off += (rem % pc.shape[d]) * pc.stride[d];
        rem /= pc.shape[d];
    }
    pc.y.v[e] = pc.x.v[off];
}
