#version 450
// NonZero for an input known at load time (so the count of non-zeros, hence the output shape,
// is known): one invocation walks x in order and writes the coordinates of each non-zero. A long
// x is walked in pieces (elements start .. start+count-1), one dispatch each; first: the count of
// non-zeros before the piece, known when the kernel is built.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 1) in;

layout(push_constant) uniform Args {
    TBUF x;
    I64Buf y;
    uint n;
    uint nnz;
    uint rank;
    uint shape[6];
    uint start;
    uint count;
    uint first;
} pc;

void main() {
    uint k = pc.first;
    for (uint e = pc.start; e < min(pc.n, pc.start + pc.count) && k < pc.nnz; ++e) {
        if (pc.x.v[e] == T(0)) continue;
        uint rem = e;
        for (int d = int(pc.rank) - 1; d >= 0; --d) {
            pc.y.v[uint(d) * pc.nnz + k] = int64_t(rem % pc.shape[d]);
            rem /= pc.shape[d];
        }
        ++k;
    }
}
