#version 450
// ReverseSequence: x viewed as [D0, D1, inner] with the batch on axis BATCH_AXIS (0 or 1) and the
// time on the other; row b reverses its first lens[b] time steps and copies the rest. WT/WBUF
// move one element unchanged; LBUF/LT are the lengths' type.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    WBUF x;
    LBUF lens;
    WBUF y;
    uint n;
    uint d1;
    uint inner;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint k = i % pc.inner, t = i / pc.inner;
    uint a1 = t % pc.d1, a0 = t / pc.d1;
#if BATCH_AXIS == 0
    uint b = a0, step = a1;
#else
    uint b = a1, step = a0;
#endif
    int64_t len = int64_t(pc.lens.v[b]);
    uint from = int64_t(step) < len ? uint(len - 1 - int64_t(step)) : step;
#if BATCH_AXIS == 0
    uint src = (a0 * pc.d1 + from) * pc.inner + k;
#else
    uint src = (from * pc.d1 + a1) * pc.inner + k;
#endif
    pc.y.v[i] = pc.x.v[src];
}
