#version 450
// Hardmax: 1 at the first maximum of each line of x viewed as [outer, n, inner], 0 elsewhere.
// One invocation per line.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf y;
    uint lines;
    uint n;
    uint inner;
} pc;

void main() {
    uint line = flat_index();
    if (line >= pc.lines) return;
    uint base = (line / pc.inner) * pc.n * pc.inner + line % pc.inner;
    uint best = 0;
    float bv = pc.x.v[base];
    for (uint i = 1; i < pc.n; ++i) {
        float v = pc.x.v[base + i * pc.inner];
        if (v > bv) { bv = v; best = i; }
    }
    for (uint i = 0; i < pc.n; ++i) pc.y.v[base + i * pc.inner] = i == best ? 1.0 : 0.0;
}
