#version 450
// AffineGrid: for every output position (n, [d,] h, w), theta[n] (ND x ND+1) times the position's
// normalised coordinates (x from w, y from h[, z from d], 1); a coordinate is -1 + i * 2/(S - 1)
// with ALIGN (corner pixel centres at +-1), else -1 + (2i + 1)/S. 2-D grids have OD = 1.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf theta;
    F32Buf grid;
    uint n;
} pc;

float coordinate(uint i, uint size) {
#if ALIGN
    return size > 1u ? -1.0 + float(i) * 2.0 / float(size - 1u) : -1.0;
#else
    return -1.0 + float(2u * i + 1u) / float(size);
#endif
}

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint w = i % OW; uint t = i / OW;
    uint h = t % OH; t /= OH;
    uint d = t % OD; uint b = t / OD;
    float p[4] = float[4](coordinate(w, OW), coordinate(h, OH), ND == 3 ? coordinate(d, OD) : 1.0, 1.0);
    for (uint r = 0; r < ND; ++r) {
        float acc = 0.0;
        for (uint c = 0; c <= ND; ++c) acc += pc.theta.v[(b * ND + r) * (ND + 1u) + c] * p[c == ND ? 3u : c];
        pc.grid.v[i * ND + r] = acc;
    }
}
