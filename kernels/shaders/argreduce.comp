#version 450
// ArgMax/ArgMin along one axis of x viewed as [outer, n, inner]; int64 indices out.
// ROW_THREADS == 1: one invocation per output; otherwise a workgroup per output whose threads
// keep a (value, index) champion each and merge them in shared memory.
// OP 0 ArgMax, 1 ArgMin; LAST = select_last_index (ties keep the largest index).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#if ROW_THREADS == 1
layout(local_size_x = 64) in;
#else
layout(local_size_x = ROW_THREADS) in;
shared T best_v[ROW_THREADS];
shared uint best_i[ROW_THREADS];
#endif

layout(push_constant) uniform Args {
    TBUF x;
    I64Buf y;
    uint nout;
    uint n;
    uint inner;
} pc;

const uint NONE = 0xffffffffu;

// Whether (v, i) beats the champion (bv, bi); NONE marks an empty champion.
bool beats(T v, uint i, T bv, uint bi) {
    if (bi == NONE) return true;
    if (i == NONE) return false;
#if OP == 0
    if (v != bv) return v > bv;
#else
    if (v != bv) return v < bv;
#endif
#if LAST
    return i > bi;
#else
    return i < bi;
#endif
}

void main() {
#if ROW_THREADS == 1
    uint o = flat_index();
    uint lane = 0, nthreads = 1;
#else
    uint o = flat_group();
    uint lane = gl_LocalInvocationID.x, nthreads = ROW_THREADS;
#endif
    if (o >= pc.nout) return;  // uniform over a workgroup
    uint base = (o / pc.inner) * pc.n * pc.inner + o % pc.inner;
    T bv = T(0);
    uint bi = NONE;
    for (uint i = lane; i < pc.n; i += nthreads) {
        T v = pc.x.v[base + i * pc.inner];
        if (beats(v, i, bv, bi)) { bv = v; bi = i; }
    }
#if ROW_THREADS > 1
    best_v[lane] = bv;
    best_i[lane] = bi;
    barrier();
    for (uint s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (lane < s && beats(best_v[lane + s], best_i[lane + s], best_v[lane], best_i[lane])) {
            best_v[lane] = best_v[lane + s];
            best_i[lane] = best_i[lane + s];
        }
        barrier();
    }
    bi = best_i[0];
#endif
    if (lane == 0) pc.y.v[o] = int64_t(bi == NONE ? 0u : bi);
}
