#version 450
// GlobalAveragePool / GlobalMaxPool: one workgroup per (n, c) row of S spatial elements,
// a strided pass per invocation then a shared-memory tree. MODE 0 = max, 1 = average.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef T
#define T float
#define TBUF F32Buf
#endif
#if BYTE_T
// NOTE: 8-bit storage alone converts uint8_t only to and from 32-bit integers (glslang 13).
#define TO_FLOAT(v) float(uint(v))
#define FROM_FLOAT(v) T(uint(v))
#else
#define TO_FLOAT(v) float(v)
#define FROM_FLOAT(v) T(v)
#endif

layout(push_constant) uniform Args {
    TBUF x;
    TBUF y;
    uint S;
    uint rows;
} pc;

shared float part[LOCAL_SIZE];

float combine(float a, float b) {
#if MODE == 0
    return max(a, b);
#else
    return a + b;
#endif
}

void main() {
    const uint row = flat_group();
    const uint t = gl_LocalInvocationID.x;
    if (row >= pc.rows) return;  // uniform per workgroup: no barrier is skipped by part of it
    const uint base = row * pc.S;
#if MODE == 0
    float acc = -1.0 / 0.0;
#else
    float acc = 0.0;
#endif
    for (uint j = t; j < pc.S; j += LOCAL_SIZE) acc = combine(acc, TO_FLOAT(pc.x.v[base + j]));
    part[t] = acc;
    barrier();
    for (uint s = LOCAL_SIZE / 2; s > 0; s >>= 1) {
        if (t < s) part[t] = combine(part[t], part[t + s]);
        barrier();
    }
    if (t == 0) {
#if MODE == 0
        pc.y.v[row] = FROM_FLOAT(part[0]);
#else
        pc.y.v[row] = part[0] / float(pc.S);
#endif
    }
}
