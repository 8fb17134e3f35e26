#version 450
// Compress: x viewed as [outer, D, inner]; output slice j along the axis is input slice s(j), the
// j-th index below min(D, COND_LEN) whose condition is true (found by scanning the condition on
// the device; its count, fixed at load time, gave the output's extent). WT/WBUF move elements.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    WBUF x;
    U8Buf cond;
    WBUF y;
    uint n;
    uint D;
    uint kept;  // output extent along the axis
    uint inner;
    uint cond_len;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint k = i % pc.inner, t = i / pc.inner;
    uint j = t % pc.kept, o = t / pc.kept;
    uint seen = 0u, s = 0u;
    for (uint c = 0u; c < min(pc.D, pc.cond_len); ++c) {
        if (uint(pc.cond.v[c]) != 0u) {
            if (seen == j) { s = c; break; }
            ++seen;
        }
    }
    pc.y.v[i] = pc.x.v[(o * pc.D + s) * pc.inner + k];
}
