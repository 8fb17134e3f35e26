#version 450
// LayerNormalization (MODE 0) and RMSNormalization (MODE 1) of float16 rows of NRED contiguous
// elements (the normalised axes are the trailing ones): one workgroup of 256 invocations per row,
// every element read once into registers (PER per invocation, all loads in flight together),
// the statistics summed across the workgroup in shared memory, float32 throughout, y rounded
// once. norm.comp reads a row three times, one element after another, which on a GPU waits for
// memory at every element. Push constants as norm.comp's (x viewed as rows, no shape or mask);
// RESIDUAL / SUM_OUT, HAS_SCALE / HAS_BIAS / HAS_STATS as there. SUBGROUP_REDUCE: the sums
// through subgroupAdd and one shared value per subgroup (two barriers a sum, not nine).
// NSPLITS (defined only then): x holds a split-K product's float32 partial sums, NSPLITS slices
// of nrows * NRED values, added (in split order, loads unrolled) with the product's bias (PBIAS:
// pbias[i % pcols]) as X is read: the product's own reduction pass is not needed.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "elem_types.glsl"
#if SUBGROUP_REDUCE
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#endif
#define NT 256
#define PER ((NRED + NT - 1) / NT)
layout(local_size_x = NT) in;

layout(push_constant) uniform Args {
#ifdef NSPLITS
    F32Buf x;
#else
    F16Buf x;
#endif
    F16Buf scale;
    F16Buf bias;
    F16Buf y;
    F32Buf mean_out;
    F32Buf inv_out;
    uint nrows;
    float eps;
    uint smod;
    uint bmod;
    F16Buf res;
    F16Buf sum_out;
#ifdef NSPLITS
    F16Buf pbias;
    uint pcols;
#endif
} pc;

shared float partial[NT];

#if SUBGROUP_REDUCE
float group_sum(float v, uint lane) {
    const float mine = subgroupAdd(v);
    if (subgroupElect()) partial[gl_SubgroupID] = mine;
    barrier();
    float total = 0.0;
    for (uint k = 0; k < gl_NumSubgroups; ++k) total += partial[k];
    barrier();  // partial is free for the next sum
    return total;
}
#else
float group_sum(float v, uint lane) {
    partial[lane] = v;
    barrier();
    [[unroll]] for (uint s = NT / 2; s > 0; s >>= 1) {
        if (lane < s) partial[lane] += partial[lane + s];
        barrier();
    }
    float total = partial[0];
    barrier();  // partial is free for the next sum
    return total;
}
#endif

void main() {
    const uint row = flat_group();
    if (row >= pc.nrows) return;  // uniform over a workgroup
    const uint lane = gl_LocalInvocationID.x;
    const uint base = row * NRED;
    float v[PER];
#if HAS_SCALE
    float sc[PER];
#endif
#if HAS_BIAS
    float bi[PER];
#endif
    float acc = 0.0;
    [[unroll]] for (uint u = 0; u < PER; ++u) {
        const uint r = lane + u * NT;
        v[u] = 0.0;
        if (r < NRED) {
            // the scale and bias are loaded with X, so that their loads wait with X's instead of
            // after the sums
#if HAS_SCALE
            sc[u] = float(pc.scale.v[(base + r) % pc.smod]);
#endif
#if HAS_BIAS
            bi[u] = float(pc.bias.v[(base + r) % pc.bmod]);
#endif
#ifdef NSPLITS
            float s = 0.0;
            [[unroll]] for (uint k = 0; k < NSPLITS; ++k) s += pc.x.v[k * pc.nrows * NRED + base + r];
#if PBIAS
            s += float(pc.pbias.v[(base + r) % pc.pcols]);
#endif
            v[u] = s;
#else
            v[u] = float(pc.x.v[base + r]);
#endif
#if RESIDUAL
            v[u] += float(pc.res.v[base + r]);
#endif
        }
#if MODE == 0
        acc += v[u];
#else
        acc += v[u] * v[u];
#endif
    }
    const float n = float(NRED);
#if MODE == 0
    const float mean = group_sum(acc, lane) / n;
    acc = 0.0;
    [[unroll]] for (uint u = 0; u < PER; ++u) {
        const float d = lane + u * NT < NRED ? v[u] - mean : 0.0;
        acc += d * d;
    }
    const float inv = 1.0 / sqrt(group_sum(acc, lane) / n + pc.eps);
#if HAS_STATS
    if (lane == 0) {
        pc.mean_out.v[row] = mean;
        pc.inv_out.v[row] = inv;
    }
#endif
#else
    const float mean = 0.0;
    const float inv = 1.0 / sqrt(group_sum(acc, lane) / n + pc.eps);
#endif
    [[unroll]] for (uint u = 0; u < PER; ++u) {
        const uint r = lane + u * NT;
        if (r >= NRED) break;
        const uint i = base + r;
#if SUM_OUT
        pc.sum_out.v[i] = float16_t(v[u]);
#endif
        float o = (v[u] - mean) * inv;
#if HAS_SCALE
        o *= sc[u];
#endif
#if HAS_BIAS
        o += bi[u];
#endif
        pc.y.v[i] = float16_t(o);
    }
}
