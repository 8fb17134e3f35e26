#version 450
// GatherElements: y[i] = x[i with coordinate `axis` replaced by idx[i]]; one invocation per output.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    I_TBUF idx;
    TBUF y;
    uint n;
    uint rank;
    uint axis;
    uint ishape[6];
    uint xshape[6];
} pc;

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
    uint rem = e, off = 0, st = 1;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        uint c = rem % pc.ishape[d];
        rem /= pc.ishape[d];
        if (uint(d) == pc.axis) {
            int64_t j = int64_t(pc.idx.v[e]);
            c = uint(j < 0 ? j + int64_t(pc.xshape[d]) : j);
        }
        off += c * st;
        st *= pc.xshape[d];
    }
    pc.y.v[e] = pc.x.v[off];
}
