#version 450
// STFT: frame f of row b is x[b, f * step + n] for n < FL (CIN 1 real, 2 complex), weighted by
// the window (HAS_WINDOW) and transformed directly: y[b, f, k] = sum_n x w e^(-2 pi i k n / FL)
// for the BINS frequencies kept. Twiddles as in dft.comp: quarter turns exact.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf window;  // x when there is none (never read then)
    F32Buf y;
    uint total;
    uint samples;  // per row
    uint frames;
    uint bins;
    uint step;
    uint FL;
} pc;

const float TWO_PI = 6.28318530717958648;

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
    uint k = idx % pc.bins, t = idx / pc.bins;
    uint f = t % pc.frames, b = t / pc.frames;
    float re = 0.0, im = 0.0;
    for (uint n = 0; n < pc.FL; ++n) {
        uint at = (b * pc.samples + f * pc.step + n) * CIN;
        float w = HAS_WINDOW != 0 ? pc.window.v[n] : 1.0;
        float xr = pc.x.v[at] * w;
        float xi = CIN == 2 ? pc.x.v[at + 1u] * w : 0.0;
        vec2 tw = twiddle((k * n) % pc.FL, pc.FL);
        re += xr * tw.x + xi * tw.y;  // x * e^(-i angle)
        im += xi * tw.x - xr * tw.y;
    }
    pc.y.v[2u * idx] = re;
    pc.y.v[2u * idx + 1u] = im;
}
