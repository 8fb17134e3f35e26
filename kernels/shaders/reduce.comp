#version 450
// Reduce* over an arbitrary set of axes. The input is viewed as a collapsed shape (rank <= 6);
// bit d of `mask` marks a reduced dimension. Output elements enumerate the kept dimensions in
// order, reduced elements enumerate the reduced ones, so no transposition is ever materialised.
// ROW_THREADS == 1: one invocation per output (short reductions);
// otherwise one workgroup of ROW_THREADS invocations per output with a shared-memory tree.
// T/TBUF: element type; ACC: accumulator type; LOWEST/HIGHEST: identities of max/min in ACC.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#if ROW_THREADS == 1
layout(local_size_x = 64) in;
#else
layout(local_size_x = ROW_THREADS) in;
shared ACC partial[ROW_THREADS];
#endif

layout(push_constant) uniform Args {
    TBUF x;
    TBUF y;
    uint nout;
    uint nred;
    uint rank;
    uint mask;
    uint shape[6];
} pc;

// OP: 0 Sum, 1 Mean, 2 Max, 3 Min, 4 Prod, 5 L1, 6 L2, 7 LogSum, 8 LogSumExp, 9 SumSquare

// Offset in x of the element whose (kept or reduced, per `reduced`) coordinates flatten to `i`.
uint offset_of(uint i, bool reduced) {
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

ACC combine(ACC a, ACC b, bool as_max) {
#if OP == 2
    return max(a, b);
#elif OP == 3
    return min(a, b);
#elif OP == 4
    return a * b;
#elif OP == 8
    return as_max ? max(a, b) : a + b;
#else
    return a + b;
#endif
}

ACC identity(bool as_max) {
#if OP == 2
    return LOWEST;
#elif OP == 3
    return HIGHEST;
#elif OP == 4
    return ACC(1);
#elif OP == 8
    return as_max ? LOWEST : ACC(0);
#else
    return ACC(0);
#endif
}

ACC term(ACC v, ACC m, bool as_max) {
#if OP == 5
    return abs(v);
#elif OP == 6 || OP == 9
    return v * v;
#elif OP == 8
    return as_max ? v : exp(v - m);
#else
    return v;
#endif
}

// Reduction of term(x) over the reduced elements of output `o`, split over the row's threads.
ACC accumulate(uint base, uint lane, uint nthreads, ACC m, bool as_max) {
    ACC acc = identity(as_max);
    for (uint r = lane; r < pc.nred; r += nthreads) {
        acc = combine(acc, term(ACC(pc.x.v[base + offset_of(r, true)]), m, as_max), as_max);
    }
#if ROW_THREADS > 1
    partial[lane] = acc;
    barrier();
    for (uint s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (lane < s) partial[lane] = combine(partial[lane], partial[lane + s], as_max);
        barrier();
    }
    acc = partial[0];
    barrier();
#endif
    return acc;
}

void main() {
#if ROW_THREADS == 1
    uint o = flat_index();
    uint lane = 0;
    if (o >= pc.nout) return;
#else
    uint o = flat_group();
    uint lane = gl_LocalInvocationID.x;
    if (o >= pc.nout) return;  // uniform over the workgroup: no barrier is skipped by part of it
#endif
    uint base = offset_of(o, false);
    ACC m = ACC(0);
#if OP == 8
    m = accumulate(base, lane, ROW_THREADS, m, true);
    // all -inf (or an empty set): the result is m itself; avoid inf - inf
    bool finite_max = !isinf(m);
    ACC s = accumulate(base, lane, ROW_THREADS, finite_max ? m : ACC(0), false);
    ACC res = finite_max ? m + log(s) : m;
#else
    ACC res = accumulate(base, lane, ROW_THREADS, m, false);
#endif
#if OP == 1
    res = res / ACC(pc.nred);
#elif OP == 6
    res = sqrt(res);
#elif OP == 7
    res = log(res);
#endif
    if (lane == 0) pc.y.v[o] = T(res);
}
