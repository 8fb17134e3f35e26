#version 450
// Normalisation layers: statistics over the reduced dimensions of a row, then an elementwise
// rescale. x is viewed as in reduce.comp (collapsed shape, reduced-bit mask). x, scale, bias,
// res, y and sum_out are float32, or float16 with HALF = 1 (16-bit storage only: every value is
// widened as it is read, the statistics and the rescale are float32, y is rounded once).
// MODE 0: y = (x - mean) / sqrt(var + eps) * scale + bias   (Layer/Group/InstanceNormalization)
// MODE 1: y = x / sqrt(mean(x^2) + eps) * scale              (RMSNormalization)
// MODE 2: y = (x - mean) / (sqrt(E[x^2] - mean^2) + eps)    (MeanVarianceNormalization)
// MODE 3: y = x / ||x||_P, 0 where the norm is 0           (LpNormalization, P 1 or 2)
// Scale/bias element of input element i: (i / sdiv) % smod (bmod): a channel or a broadcast tail.
// HAS_STATS: also write the row's mean and 1/sqrt(var + eps) (LayerNormalization outputs).
// TAIL: the reduced dimensions are the trailing ones (a row is nred contiguous elements).
// RESIDUAL: x is the sum of x and res, element by element (a residual Add fused in front of a
// LayerNormalization by vkpool.fusion); SUM_OUT: that sum is also written to sum_out.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#if HALF
#include "elem_types.glsl"
#define VBUF F16Buf
#define VT float16_t
#else
#define VBUF F32Buf
#define VT float
#endif

#if ROW_THREADS == 1
layout(local_size_x = 64) in;
#else
layout(local_size_x = ROW_THREADS) in;
shared float partial[ROW_THREADS];
#endif

layout(push_constant) uniform Args {
    VBUF x;
    VBUF scale;
    VBUF bias;
    VBUF y;
    F32Buf mean_out;
    F32Buf inv_out;
    uint nrows;
    uint nred;
    uint rank;
    uint mask;
    uint shape[6];
    float eps;
    uint sdiv;
    uint smod;
    uint bmod;
    VBUF res;
    VBUF sum_out;
} pc;

float x_at(uint i) {
#if RESIDUAL
    return float(pc.x.v[i]) + float(pc.res.v[i]);
#else
    return float(pc.x.v[i]);
#endif
}

uint offset_of(uint i, bool reduced) {
#if TAIL
    return reduced ? i : i * pc.nred;
#endif
    uint off = 0, st = 1;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        uint n = pc.shape[d];
        if (((pc.mask >> uint(d)) & 1u) == (reduced ? 1u : 0u)) {
            off += (i % n) * st;
            i /= n;
        }
        st *= n;
    }
    return off;
}

// Sum over the row of f(x): KIND 0 x, 1 (x - c)^2, 2 x^2, 3 |x|.
float row_sum(uint base, uint lane, uint nthreads, uint kind, float c) {
    float acc = 0.0;
    for (uint r = lane; r < pc.nred; r += nthreads) {
        float v = x_at(base + offset_of(r, true));
        acc += kind == 0u ? v : kind == 1u ? (v - c) * (v - c) : kind == 2u ? v * v : abs(v);
    }
#if ROW_THREADS > 1
    partial[lane] = acc;
    barrier();
    for (uint s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (lane < s) partial[lane] += partial[lane + s];
        barrier();
    }
    acc = partial[0];
    barrier();
#endif
    return acc;
}

void main() {
#if ROW_THREADS == 1
    uint row = flat_index();
    uint lane = 0, nthreads = 1;
#else
    uint row = flat_group();
    uint lane = gl_LocalInvocationID.x, nthreads = ROW_THREADS;
#endif
    if (row >= pc.nrows) return;  // uniform over a workgroup
    uint base = offset_of(row, false);
    float n = float(pc.nred);
    float mul = 1.0, sub = 0.0;
#if MODE == 0
    float mean = row_sum(base, lane, nthreads, 0u, 0.0) / n;
    float var = row_sum(base, lane, nthreads, 1u, mean) / n;
    float inv = 1.0 / sqrt(var + pc.eps);
    sub = mean;
    mul = inv;
#if HAS_STATS
    if (lane == 0) {
        pc.mean_out.v[row] = mean;
        pc.inv_out.v[row] = inv;
    }
#endif
#elif MODE == 1
    mul = 1.0 / sqrt(row_sum(base, lane, nthreads, 2u, 0.0) / n + pc.eps);
#elif MODE == 2
    float mean = row_sum(base, lane, nthreads, 0u, 0.0) / n;
    float ex2 = row_sum(base, lane, nthreads, 2u, 0.0) / n;
    sub = mean;
    mul = 1.0 / (sqrt(max(ex2 - mean * mean, 0.0)) + pc.eps);
#elif MODE == 3
#if P == 1
    float norm = row_sum(base, lane, nthreads, 3u, 0.0);
#else
    float norm = sqrt(row_sum(base, lane, nthreads, 2u, 0.0));
#endif
    mul = norm == 0.0 ? 0.0 : 1.0 / norm;
#endif
    for (uint r = lane; r < pc.nred; r += nthreads) {
        uint i = base + offset_of(r, true);
        float xi = x_at(i);
#if SUM_OUT
        pc.sum_out.v[i] = VT(xi);
#endif
        float v = (xi - sub) * mul;
#if MODE == 3
        v = norm == 0.0 ? 0.0 : xi / norm;
#endif
#if HAS_SCALE
        v *= float(pc.scale.v[(i / pc.sdiv) % pc.smod]);
#endif
#if HAS_BIAS
        v += float(pc.bias.v[(i / pc.sdiv) % pc.bmod]);
#endif
        pc.y.v[i] = VT(v);
    }
}
