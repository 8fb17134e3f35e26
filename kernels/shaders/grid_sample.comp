#version 450
// GridSample, 2-D or 3-D (a 2-D input has ID = OD = 1), one output element per invocation.
// Geometry is compiled in: C channels, I* input and O* output extents, ND grid components.
// The grid's (x, y[, z]) in [-1, 1] map to input coordinates (ALIGN: corner pixel centres), then
// MODE 0 takes the nearest pixel (ties to even), 1 interpolates linearly, 2 cubically (Keys,
// a = -0.75), separably per axis. PAD 0 reads zeros outside the input, 1 clamps coordinates and
// indices to the border, 2 reflects them at the border (the edges, or the corner centres with ALIGN).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf grid;
    F32Buf y;
    uint n;
} pc;

#if MODE == 0
#define TAPS 1
#elif MODE == 1
#define TAPS 2
#else
#define TAPS 4
#endif

float denormalize(float g, float size) {
#if ALIGN
    return (g + 1.0) * 0.5 * (size - 1.0);
#else
    return ((g + 1.0) * size - 1.0) * 0.5;
#endif
}

// reflect x into [lo, hi] by its nearer border, as often as it takes
float reflect_(float x, float lo, float hi) {
    float range = hi - lo;
    if (range <= 0.0) return lo;
    if (x < lo) {
        float dx = lo - x;
        int n = int(dx / range);
        float r = dx - float(n) * range;
        return n % 2 == 0 ? lo + r : hi - r;
    }
    if (x > hi) {
        float dx = x - hi;
        int n = int(dx / range);
        float r = dx - float(n) * range;
        return n % 2 == 0 ? hi - r : lo + r;
    }
    return x;
}

float cubic_weight(float t) {  // Keys' kernel at distance |t| <= 2
    const float a = -0.75;
    t = abs(t);
    if (t <= 1.0) return ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0;
    return ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a;
}

// the taps along one axis of `size` pixels: first index and the weights, for coordinate g
void taps(float g, int size, out int first, out float w[TAPS]) {
    float x = denormalize(g, float(size));
#if ALIGN
    float lo = 0.0, hi = float(size) - 1.0;
#else
    float lo = -0.5, hi = float(size) - 0.5;
#endif
#if MODE == 0
    x = roundEven(x);
#endif
    if (x < lo || x > hi) {
#if PAD == 1
        x = clamp(x, 0.0, float(size) - 1.0);
#elif PAD == 2
        x = reflect_(x, lo, hi);
#endif
    }
#if MODE == 0
    first = int(x);
    w[0] = 1.0;
#else
    float f = floor(x), t = x - f;
#if MODE == 1
    first = int(f);
    w[0] = 1.0 - t;
    w[1] = t;
#else
    first = int(f) - 1;
    for (int k = 0; k < 4; ++k) w[k] = cubic_weight(t + 1.0 - float(k));
#endif
#endif
}

// a tap's index inside the input, or -1 where it reads the zero padding
int pixel_index(int i, int size) {
#if PAD == 0
    return (i < 0 || i >= size) ? -1 : i;
#elif PAD == 1
    return clamp(i, 0, size - 1);
#else
#if ALIGN
    float lo = 0.0, hi = float(size) - 1.0;
#else
    float lo = -0.5, hi = float(size) - 0.5;
#endif
    return clamp(int(reflect_(float(i), lo, hi)), 0, size - 1);
#endif
}

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint ow = i % OW; uint t = i / OW;
    uint oh = t % OH; t /= OH;
    uint od = t % OD; t /= OD;
    uint b = t / C;
    uint g = (((b * OD + od) * OH + oh) * OW + ow) * ND;
    int fw, fh, fd = 0;
    float ww[TAPS], wh[TAPS], wd[TAPS];
    taps(pc.grid.v[g], IW, fw, ww);
    taps(pc.grid.v[g + 1], IH, fh, wh);
#if ND == 3
    taps(pc.grid.v[g + 2], ID, fd, wd);
    const int DT = TAPS;
#else
    wd[0] = 1.0;
    const int DT = 1;
#endif
    uint plane = t * (ID * IH * IW);  // t = b * C + c
    float acc = 0.0;
    for (int a = 0; a < DT; ++a) {
        int id = ND == 3 ? pixel_index(fd + a, ID) : 0;
        for (int r = 0; r < TAPS; ++r) {
            int ih = pixel_index(fh + r, IH);
            for (int s = 0; s < TAPS; ++s) {
                int iw = pixel_index(fw + s, IW);
                if (id < 0 || ih < 0 || iw < 0) continue;
                acc += wd[a] * wh[r] * ww[s] * pc.x.v[plane + (uint(id) * IH + uint(ih)) * IW + uint(iw)];
            }
        }
    }
    pc.y.v[i] = acc;
}
