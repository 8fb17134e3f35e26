#version 450
// Reads BYTES of memory so that they sit in the L2 cache for the next dispatch
// (bench/l2_prefetch_probe.py): every invocation folds its 16-byte vectors into one value,
// written only if it equals a constant no real weights produce, so the loads stay.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 256) in;
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4Buf { uvec4 v[]; };

layout(push_constant) uniform Args {
    U4Buf src;
    U4Buf sink;
    uint vectors;
} pc;

void main() {
    uvec4 acc = uvec4(0u);
    const uint stride = gl_NumWorkGroups.x * 256u;
    for (uint i = gl_GlobalInvocationID.x; i < pc.vectors; i += stride) acc ^= pc.src.v[i];
    if (acc.x == 0x9E3779B9u && acc.y == 0x7F4A7C15u && acc.z == 0xF39CC060u) pc.sink.v[0] = acc;
}
