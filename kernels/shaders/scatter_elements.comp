#version 450
// ScatterElements after y = copy(x) (COPY == 1 is that copy). One invocation per line of
// `updates` along `axis`, walking the line in order: lines write disjoint lines of y, so no
// two invocations touch one element and duplicate indices apply in order, without atomics.
// RED: 0 none, 1 add, 2 mul, 3 max, 4 min.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    I_TBUF idx;
    TBUF upd;
    TBUF y;
    uint n;      // COPY: elements of x; else lines of updates
    uint rank;
    uint axis;
    uint ushape[6];
    uint xshape[6];
} pc;

T combine(T old, T v) {
#if RED == 1
    return old + v;
#elif RED == 2
    return old * v;
#elif RED == 3
    return max(old, v);
#elif RED == 4
    return min(old, v);
#else
    return v;
#endif
}

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
#if COPY
    pc.y.v[e] = pc.x.v[e];
#else
    // offsets of the line's first element in updates and in y (axis coordinate 0)
    uint rem = e, uoff = 0, yoff = 0, ust = 1, yst = 1, ustride = 1, ystride = 1;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        if (uint(d) == pc.axis) {
            ustride = ust;
            ystride = yst;
        } else {
            uint c = rem % pc.ushape[d];
            rem /= pc.ushape[d];
            uoff += c * ust;
            yoff += c * yst;
        }
        ust *= pc.ushape[d];
        yst *= pc.xshape[d];
    }
    int64_t extent = int64_t(pc.xshape[pc.axis]);
    for (uint k = 0; k < pc.ushape[pc.axis]; ++k) {
        uint u = uoff + k * ustride;
        int64_t j = int64_t(pc.idx.v[u]);
        uint t = yoff + uint(j < 0 ? j + extent : j) * ystride;
        pc.y.v[t] = combine(pc.y.v[t], pc.upd.v[u]);
    }
#endif
}
