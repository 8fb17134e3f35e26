#version 450
// y[n] = alpha * dot(x, B[n, :]) + beta * c[n] for a single row x, with B's rows contiguous
// along K (B[n][k] at n * sBn + k): a Gemm with transB = 1, or a MatMul by a K x 1 matrix.
// TPR invocations share one output row, each reading VEC-wide slices strided by TPR * VEC,
// so a row is streamed in contiguous chunks; partial dots are combined in shared memory.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"
// SUBGROUP_REDUCE (one row per workgroup only): the partial dots are summed within each subgroup
// first, so one barrier replaces the shared-memory tree's log2(TPR)
#ifndef SUBGROUP_REDUCE
#define SUBGROUP_REDUCE 0
#endif
#if SUBGROUP_REDUCE
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif

#ifndef TPR
#define TPR 32
#endif
#ifndef ROWS
#define ROWS 8
#endif
layout(local_size_x = TPR, local_size_y = ROWS) in;

#if VEC == 4
#define VT vec4
#define VBUF V4Buf
#else
#define VT float
#define VBUF F32Buf
#endif

layout(push_constant) uniform Args {
    VBUF x;
    VBUF b;
    F32Buf c;
    F32Buf y;
    uint N, K, sBn, sCn;
    float alpha, beta;
} pc;

shared float red[ROWS][TPR];

float hsum(VT v) {
#if VEC == 4
    return (v.x + v.y) + (v.z + v.w);
#else
    return v;
#endif
}

void main() {
    const uint t = gl_LocalInvocationID.x, r = gl_LocalInvocationID.y;
    const uint n = flat_group() * ROWS + r;
    const uint kv = pc.K / VEC;           // row length in units of VT
    const uint rowBase = n * (pc.sBn / VEC);
    VT acc0 = VT(0.0), acc1 = VT(0.0), acc2 = VT(0.0), acc3 = VT(0.0);
    if (n < pc.N) {
        uint k = t;
        for (; k + 3 * TPR < kv; k += 4 * TPR) {
            acc0 += pc.x.v[k] * pc.b.v[rowBase + k];
            acc1 += pc.x.v[k + TPR] * pc.b.v[rowBase + k + TPR];
            acc2 += pc.x.v[k + 2 * TPR] * pc.b.v[rowBase + k + 2 * TPR];
            acc3 += pc.x.v[k + 3 * TPR] * pc.b.v[rowBase + k + 3 * TPR];
        }
        for (; k < kv; k += TPR) acc0 += pc.x.v[k] * pc.b.v[rowBase + k];
    }
#if SUBGROUP_REDUCE
    const float part = subgroupAdd(hsum((acc0 + acc1) + (acc2 + acc3)));
    if (subgroupElect()) red[0][gl_SubgroupID] = part;
    barrier();
    if (gl_SubgroupID != 0u) return;
    float total = 0.0;
    for (uint i = gl_SubgroupInvocationID; i < gl_NumSubgroups; i += gl_SubgroupSize) total += red[0][i];
    total = subgroupAdd(total);
    if (!subgroupElect() || n >= pc.N) return;
    float v = pc.alpha * total;
#else
    red[r][t] = hsum((acc0 + acc1) + (acc2 + acc3));
    barrier();
    for (uint s = TPR / 2; s > 0; s >>= 1) {
        if (t < s) red[r][t] += red[r][t + s];
        barrier();
    }
    if (t != 0 || n >= pc.N) return;
    float v = pc.alpha * red[r][0];
#endif
#if HAS_BIAS
    v += pc.beta * pc.c.v[n * pc.sCn];
#endif
    v = epilogue(v);
    pc.y.v[n] = v;
}
