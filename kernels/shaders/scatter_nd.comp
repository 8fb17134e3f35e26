#version 450
// ScatterND after y = copy(x) (COPY == 1 is that copy). One invocation per element of a
// slice, walking every index tuple in order: invocations own disjoint elements, so duplicate
// indices apply in order without atomics. RED: 0 none, 1 add, 2 mul, 3 max, 4 min.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    I_TBUF idx;
    TBUF upd;
    TBUF y;
    uint n;       // COPY: elements of x; else elements per slice
    uint tuples;
    uint k;
    uint dims[6];
    uint strides[6];
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
    for (uint t = 0; t < pc.tuples; ++t) {
        uint off = e;
        for (uint j = 0; j < pc.k; ++j) {
            int64_t i = int64_t(pc.idx.v[t * pc.k + j]);
            off += uint(i < 0 ? i + int64_t(pc.dims[j]) : i) * pc.strides[j];
        }
        pc.y.v[off] = combine(pc.y.v[off], pc.upd.v[t * pc.n + e]);
    }
#endif
}
