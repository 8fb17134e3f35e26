#version 450
// DFT along one axis, directly (O(N L) per line): x viewed as [outer, N, inner, CIN] (CIN 1 real,
// 2 complex), y as [outer, LOUT, inner, COUT]. MODE 0 forward, 1 inverse (divided by L), both
// complex out; MODE 2 the inverse of a one-sided spectrum (numpy's irfft), real out. Inputs past
// L are ignored and missing ones are zeros. Angles reduce k * n modulo L in integers first, so
// the argument of cos/sin stays in [0, 2 pi).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf y;
    uint total;
    uint N;
    uint LOUT;
    uint L;
    uint inner;
} pc;

const float TWO_PI = 6.28318530717958648;

// (cos, sin) of 2 pi r / L; quarter turns exactly, so that a real signal's DC and Nyquist bins
// get an imaginary part of exactly 0, as an FFT gives them
vec2 twiddle(uint r, uint L) {
    if ((4u * r) % L == 0u) {
        uint q = 4u * r / L;
        return q == 0u ? vec2(1.0, 0.0) : q == 1u ? vec2(0.0, 1.0) : q == 2u ? vec2(-1.0, 0.0) : vec2(0.0, -1.0);
    }
    float angle = TWO_PI * float(r) / float(L);
    return vec2(cos(angle), sin(angle));
}

void main() {
    uint idx = flat_index();
    if (idx >= pc.total) return;
    uint i = idx % pc.inner, t = idx / pc.inner;
    uint k = t % pc.LOUT, o = t / pc.LOUT;
    uint count = min(pc.N, MODE == 2 ? pc.L / 2u + 1u : pc.L);
    float re = 0.0, im = 0.0;
    for (uint n = 0; n < count; ++n) {
        uint at = ((o * pc.N + n) * pc.inner + i) * CIN;
        float xr = pc.x.v[at];
        float xi = CIN == 2 ? pc.x.v[at + 1u] : 0.0;
        vec2 w = twiddle((k * n) % pc.L, pc.L);
        float c = w.x, s = w.y;
#if MODE == 0
        re += xr * c + xi * s;  // x * e^(-i angle)
        im += xi * c - xr * s;
#elif MODE == 1
        re += xr * c - xi * s;  // x * e^(+i angle)
        im += xr * s + xi * c;
#else
        // bins 1 .. ceil(L/2) - 1 stand for themselves and their conjugate mirror; bin 0 and,
        // for an even L, bin L/2 once, real parts only
        bool single = n == 0u || 2u * n == pc.L;
        re += single ? xr * (n == 0u ? 1.0 : c) : 2.0 * (xr * c - xi * s);
#endif
    }
    uint out_at = ((o * pc.LOUT + k) * pc.inner + i) * COUT;
#if MODE == 0
    pc.y.v[out_at] = re;
    pc.y.v[out_at + 1u] = im;
#elif MODE == 1
    pc.y.v[out_at] = re / float(pc.L);
    pc.y.v[out_at + 1u] = im / float(pc.L);
#else
    pc.y.v[out_at] = re / float(pc.L);
#endif
}
