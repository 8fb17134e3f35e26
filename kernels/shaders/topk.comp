#version 450
// TopK along an axis of x viewed as [outer, n, inner]. One invocation per input element
// computes its rank in its line (ties: the lower index first, as ONNX requires); the
// elements ranked below k write themselves to that position, so the output is sorted.
// LARGEST selects the order. A long line is counted in pieces (j = start .. start+count-1), one
// dispatch each, the partial rank carried in ranks[] between them; the last piece writes.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    TBUF values;
    I64Buf indices;
    U32Buf ranks;  // x when the line is counted in one piece
    uint total;
    uint n;
    uint inner;
    uint k;
    uint start;
    uint count;
} pc;

bool before(T a, uint ia, T b, uint ib) {
#if LARGEST
    if (a != b) return a > b;
#else
    if (a != b) return a < b;
#endif
    return ia < ib;
}

void main() {
    uint e = flat_index();
    if (e >= pc.total) return;
    uint in_ = e % pc.inner;
    uint i = (e / pc.inner) % pc.n;
    uint outer = e / (pc.inner * pc.n);
    uint base = outer * pc.n * pc.inner + in_;
    T v = pc.x.v[e];
    uint rank = pc.start > 0 ? pc.ranks.v[e] : 0u;
    uint end = min(pc.n, pc.start + pc.count);
    for (uint j = pc.start; j < end && rank < pc.k; ++j) {
        if (before(pc.x.v[base + j * pc.inner], j, v, i)) ++rank;
    }
    if (end < pc.n) {
        pc.ranks.v[e] = rank;
    } else if (rank < pc.k) {
        uint o = (outer * pc.k + rank) * pc.inner + in_;
        pc.values.v[o] = v;
        pc.indices.v[o] = int64_t(i);
    }
}
