#version 450
// Softmax / LogSoftmax over one axis: one workgroup per row (all indices but the axis).
// A row's D elements lie `inner` apart, starting at outer * D * inner + i_inner. Three
// strided passes (max, sum of exponentials, write), each combined in shared memory.
// MODE 0 = Softmax, 1 = LogSoftmax. X* the element type (float32/float16; float32 arithmetic).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;
// SUBGROUP_REDUCE: maximum and sum are taken within each subgroup first, so each costs two
// barriers instead of the shared-memory tree's log2(LOCAL_SIZE)
#ifndef SUBGROUP_REDUCE
#define SUBGROUP_REDUCE 0
#endif
#if SUBGROUP_REDUCE
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif

#ifndef XT
#define XT float
#define XBUF F32Buf
#endif
#define LOAD(k) float(pc.x.v[k])

layout(push_constant) uniform Args {
    XBUF x;
    XBUF y;
    uint D;
    uint inner;
    uint rows;
} pc;

shared float part[LOCAL_SIZE];

void main() {
    const uint row = flat_group();
    const uint t = gl_LocalInvocationID.x;
    if (row >= pc.rows) return;  // uniform per workgroup
    const uint inner = pc.inner, D = pc.D;
    const uint base = (row / inner) * D * inner + row % inner;

    float m = -1.0 / 0.0;
    for (uint j = t; j < D; j += LOCAL_SIZE) m = max(m, LOAD(base + j * inner));
#if SUBGROUP_REDUCE
    m = subgroupMax(m);
    if (subgroupElect()) part[gl_SubgroupID] = m;
    barrier();
    if (gl_SubgroupID == 0u) {
        float v = -1.0 / 0.0;
        for (uint i = gl_SubgroupInvocationID; i < gl_NumSubgroups; i += gl_SubgroupSize) v = max(v, part[i]);
        v = subgroupMax(v);
        if (subgroupElect()) part[LOCAL_SIZE - 1] = v;
    }
    barrier();
    m = part[LOCAL_SIZE - 1];
    barrier();
#else
    part[t] = m;
    barrier();
    for (uint s = LOCAL_SIZE / 2; s > 0; s >>= 1) {
        if (t < s) part[t] = max(part[t], part[t + s]);
        barrier();
    }
    m = part[0];
    barrier();
#endif

    float sum = 0.0;
    for (uint j = t; j < D; j += LOCAL_SIZE) sum += exp(LOAD(base + j * inner) - m);
#if SUBGROUP_REDUCE
    sum = subgroupAdd(sum);
    if (subgroupElect()) part[gl_SubgroupID] = sum;
    barrier();
    if (gl_SubgroupID == 0u) {
        float v = 0.0;
        for (uint i = gl_SubgroupInvocationID; i < gl_NumSubgroups; i += gl_SubgroupSize) v += part[i];
        v = subgroupAdd(v);
        if (subgroupElect()) part[LOCAL_SIZE - 1] = v;
    }
    barrier();
    sum = part[LOCAL_SIZE - 1];
#else
    part[t] = sum;
    barrier();
    for (uint s = LOCAL_SIZE / 2; s > 0; s >>= 1) {
        if (t < s) part[t] += part[t + s];
        barrier();
    }
    sum = part[0];
#endif

#if MODE == 0
    const float scale = 1.0 / sum;
    for (uint j = t; j < D; j += LOCAL_SIZE) {
        uint k = base + j * inner;
        pc.y.v[k] = XT(exp(LOAD(k) - m) * scale);
    }
#else
    const float shift = m + log(sum);
    for (uint j = t; j < D; j += LOCAL_SIZE) {
        uint k = base + j * inner;
        pc.y.v[k] = XT(LOAD(k) - shift);
    }
#endif
}
