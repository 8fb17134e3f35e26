#version 450
// Gather along one axis: y[o, j, k] = x[o, idx[j], k] with x viewed as [outer, axis_dim, inner]
// and the indices flattened to j. Negative indices count from the end.
// WT/WBUF: the element word (no conversion); IBUF: I64Buf or I32Buf for the indices.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    WBUF x;
    IBUF idx;
    WBUF y;
    uint n;
    uint inner;
    uint count;     // number of indices
    uint axis_dim;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint k = i % pc.inner;
    uint rest = i / pc.inner;
    uint j = rest % pc.count;
    uint o = rest / pc.count;
    int64_t t = int64_t(pc.idx.v[j]);
    if (t < 0) t += int64_t(pc.axis_dim);
    pc.y.v[i] = pc.x.v[(o * pc.axis_dim + uint(t)) * pc.inner + k];
}
