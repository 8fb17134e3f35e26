#version 450
// GatherND with batch_dims: one invocation per output element. An output element is
// (index tuple `t`, element `inner` of the gathered slice); the tuple's batch is t / batch_inner.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    I_TBUF idx;
    TBUF y;
    uint n;
    uint k;            // length of an index tuple
    uint slice;        // elements per gathered slice
    uint batch_inner;  // index tuples per batch
    uint batch_stride; // elements of x per batch
    uint dims[6];      // extents of the indexed dimensions of x
    uint strides[6];   // their element strides
} pc;

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
    uint t = e / pc.slice, inner = e % pc.slice;
    uint off = (t / pc.batch_inner) * pc.batch_stride + inner;
    for (uint j = 0; j < pc.k; ++j) {
        int64_t i = int64_t(pc.idx.v[t * pc.k + j]);
        off += uint(i < 0 ? i + int64_t(pc.dims[j]) : i) * pc.strides[j];
    }
    pc.y.v[e] = pc.x.v[off];
}
