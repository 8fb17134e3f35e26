#version 450
// y = alpha * x @ B + beta * c for a single row x, with B's columns contiguous (B[k][n] at
// k * sBk + n). Each invocation owns VEC adjacent columns (one vec4 load per row when
// VEC == 4) and every TYG-th row of the workgroup's K chunk, so a workgroup reads
// TXG * VEC contiguous columns per row: wide, coalesced, and B is read exactly once.
// The TYG partial sums are combined in shared memory. With SPLIT, gl_WorkGroupID.y picks a
// K chunk and raw partial sums go to ws[chunk][n] for gemm_reduce.comp to finish.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"

#ifndef TXG
#define TXG 64
#endif
#ifndef TYG
#define TYG 4
#endif
layout(local_size_x = TXG, local_size_y = TYG) in;

layout(push_constant) uniform Args {
    F32Buf x;
#if VEC == 4
    V4Buf b;
#else
    F32Buf b;
#endif
    F32Buf c;
    F32Buf y;    // the output, or the partial-sum workspace with SPLIT
    uint N, K, sx, sBk, kchunk, sCn;
    float alpha, beta;
} pc;

#if VEC == 4
#define VT vec4
#else
#define VT float
#endif

shared VT red[TYG][TXG];

void main() {
    const uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    const uint col = gl_WorkGroupID.x * TXG + tx;      // in units of VEC columns
    const bool live = col * VEC < pc.N;
    const uint k0 = gl_WorkGroupID.y * pc.kchunk;
    const uint k1 = min(k0 + pc.kchunk, pc.K);
    const uint rowStride = pc.sBk / VEC;               // B row stride in units of VT
    VT acc0 = VT(0.0), acc1 = VT(0.0), acc2 = VT(0.0), acc3 = VT(0.0);
    if (live) {
        uint k = k0 + ty;
        // four independent accumulators keep four weight loads in flight per invocation
        for (; k + 3 * TYG < k1; k += 4 * TYG) {
            acc0 += pc.x.v[k * pc.sx] * pc.b.v[k * rowStride + col];
            acc1 += pc.x.v[(k + TYG) * pc.sx] * pc.b.v[(k + TYG) * rowStride + col];
            acc2 += pc.x.v[(k + 2 * TYG) * pc.sx] * pc.b.v[(k + 2 * TYG) * rowStride + col];
            acc3 += pc.x.v[(k + 3 * TYG) * pc.sx] * pc.b.v[(k + 3 * TYG) * rowStride + col];
        }
        for (; k < k1; k += TYG) acc0 += pc.x.v[k * pc.sx] * pc.b.v[k * rowStride + col];
    }
    red[ty][tx] = (acc0 + acc1) + (acc2 + acc3);
    barrier();
    if (ty != 0 || !live) return;
    VT s = red[0][tx];
    for (uint r = 1; r < TYG; ++r) s += red[r][tx];
#if VEC == 4
    float parts[4] = float[4](s.x, s.y, s.z, s.w);
#else
    float parts[1] = float[1](s);
#endif
    for (uint j = 0; j < VEC; ++j) {
        uint n = col * VEC + j;
#if SPLIT
        pc.y.v[gl_WorkGroupID.y * pc.N + n] = parts[j];
#else
        float v = pc.alpha * parts[j];
#if HAS_BIAS
        v += pc.beta * pc.c.v[n * pc.sCn];
#endif
        v = epilogue(v);
        pc.y.v[n] = v;
#endif
    }
}
