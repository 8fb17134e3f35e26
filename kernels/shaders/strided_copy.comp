#version 450
// Moves elements between a contiguous tensor and a strided view of another, rank <= 8.
// Gather (default): y[i] = x[base + sum_d c_d * stride_d] with c the coordinates of i in shape.
// SCATTER: y[base + sum_d c_d * stride_d] = x[i]. Strides are signed (negative Slice steps);
// every computed index is a valid element, so it is never negative.
// WT/WBUF: the word moved, by element size only (kernels/ops/dtypes.py): no conversion.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef SCATTER
#define SCATTER 0
#endif

layout(push_constant) uniform Args {
    WBUF x;
    WBUF y;
    uint n;
    uint rank;
    int base;
    uint shape[8];
    int stride[8];
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    int off = pc.base;
    uint rem = i;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        uint c = rem % pc.shape[d];
        rem /= pc.shape[d];
        off += int(c) * pc.stride[d];
    }
#if SCATTER
    pc.y.v[uint(off)] = pc.x.v[i];
#else
    pc.y.v[i] = pc.x.v[uint(off)];
#endif
}
