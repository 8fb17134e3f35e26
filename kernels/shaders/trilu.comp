#version 450
// Trilu: keep the upper (UPPER) or lower triangle of the last two dimensions, the diagonal
// shifted by k (read from a tensor when HAS_K, so it may be a graph input).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    I64Buf k;
    TBUF y;
    uint n;
    uint rows;
    uint cols;
} pc;

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
#if HAS_K
    int64_t k = pc.k.v[0];
#else
    int64_t k = 0;
#endif
    int64_t j = int64_t(e % pc.cols);
    int64_t i = int64_t((e / pc.cols) % pc.rows);
#if UPPER
    bool keep = j - i >= k;
#else
    bool keep = j - i <= k;
#endif
    pc.y.v[e] = keep ? pc.x.v[e] : T(0);
}
