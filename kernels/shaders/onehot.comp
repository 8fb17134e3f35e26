#version 450
// OneHot: y[outer, d, inner] = values[indices[outer, inner] == d ? 1 : 0], a negative index
// counting from depth. indices may be of any numeric type (I_T); values are read on the device.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    I_TBUF indices;
    TBUF values;
    TBUF y;
    uint n;
    uint depth;
    uint inner;
} pc;

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
    uint in_ = e % pc.inner;
    uint d = (e / pc.inner) % pc.depth;
    uint outer = e / (pc.inner * pc.depth);
    int64_t i = int64_t(pc.indices.v[outer * pc.inner + in_]);
    if (i < 0) i += int64_t(pc.depth);
    pc.y.v[e] = pc.values.v[i == int64_t(d) ? 1 : 0];
}
