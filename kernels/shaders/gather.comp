#version 450
// Gather along one axis: y[o, j, k] = x[o, idx[j], k] with x viewed as [outer, axis_dim, inner]
// and the indices flattened to j. Negative indices count from the end.
// WT/WBUF: the element word (no conversion); IBUF/IT: I64Buf/int64_t or I32Buf/int for the indices.
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
    // NOTE: on lavapipe (llvmpipe, LLVM 15) int64_t(pc.idx.v[j]) of an int32 index read through
    // a buffer reference came out zero-extended (-2 became 4294967294); glslang or the driver,
    // not isolated. An int32 index therefore stays int32 here.
    IT t = pc.idx.v[j];
    if (t < IT(0)) t += IT(pc.axis_dim);
    pc.y.v[i] = pc.x.v[(o * pc.axis_dim + uint(t)) * pc.inner + k];
}
