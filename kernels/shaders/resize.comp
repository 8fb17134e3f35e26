#version 450
// One axis of Resize: x [outer, in_w, inner] -> y [outer, out_w, inner]. Resize is separable,
// so an N-D resize is one such pass per resized axis (in axis order, as ONNX's reference does,
// which also fixes how extrapolated values mix). One invocation per output element.
// MODE 0 nearest (NEAREST 0 round_prefer_floor, 1 round_prefer_ceil, 2 floor, 3 ceil),
// 1 linear, 2 cubic. CTM 0 half_pixel, 1 half_pixel_symmetric, 2 pytorch_half_pixel,
// 3 align_corners, 4 asymmetric, 5 tf_crop_and_resize (roi read on the device, ROI_T/ROI_TBUF).
// `taps` neighbours start at floor(x) + tap0; weights are kernel((tap - frac) * aa) normalised
// when antialiasing (aa < 1); EXCLUDE zeroes the weights of neighbours outside the input.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    F32Buf x;
    ROI_TBUF roi;
    F32Buf y;
    uint n;
    uint in_w;
    uint out_w;
    uint inner;
    float scale;
    float aa;          // min(scale, 1) when antialiasing, else 1
    int tap0;
    uint taps;
    uint roi_lo;       // element index of this axis' roi start (its end is roi_hi)
    uint roi_hi;
    float extrapolation;
    float cubic_a;
} pc;

float kernel_weight(float t) {
#if MODE == 1
    return max(1.0 - abs(t), 0.0);
#else
    float a = pc.cubic_a, u = abs(t);
    if (u <= 1.0) return ((a + 2.0) * u - (a + 3.0)) * u * u + 1.0;
    if (u < 2.0) return ((a * u - 5.0 * a) * u + 8.0 * a) * u - 4.0 * a;
    return 0.0;
#endif
}

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
    uint in_ = e % pc.inner;
    float o = float((e / pc.inner) % pc.out_w);
    uint outer = e / (pc.inner * pc.out_w);
    float in_w = float(pc.in_w);
    float out_wf = pc.scale * in_w;  // ONNX's "output_width" (not rounded)
    float xo;
#if CTM == 0
    xo = (o + 0.5) / pc.scale - 0.5;
#elif CTM == 1
    float adjustment = float(pc.out_w) / out_wf;
    xo = in_w / 2.0 * (1.0 - adjustment) + (o + 0.5) / pc.scale - 0.5;
#elif CTM == 2
    xo = out_wf == 1.0 ? -0.5 : (o + 0.5) / pc.scale - 0.5;
#elif CTM == 3
    xo = out_wf == 1.0 ? 0.0 : o * (in_w - 1.0) / (out_wf - 1.0);
#elif CTM == 4
    xo = o / pc.scale;
#else
    float lo = float(pc.roi.v[pc.roi_lo]), hi = float(pc.roi.v[pc.roi_hi]);
    xo = out_wf == 1.0 ? (hi - lo) * (in_w - 1.0) / 2.0 : o * (hi - lo) * (in_w - 1.0) / (out_wf - 1.0);
    xo += lo * (in_w - 1.0);
    if (xo < 0.0 || xo > in_w - 1.0) {
        pc.y.v[e] = pc.extrapolation;
        return;
    }
#endif
    // an integral coordinate is taken as floor = x - 1, frac = 1 (the reference's convention)
    float fl = floor(xo);
    float frac = xo - fl;
    if (frac == 0.0) { fl -= 1.0; frac = 1.0; }
    uint base = outer * pc.in_w * pc.inner + in_;
    int last = int(pc.in_w) - 1;
#if MODE == 0
    bool up;
#if NEAREST == 0
    up = frac > 0.5;
#elif NEAREST == 1
    up = frac >= 0.5;
#elif NEAREST == 2
    up = frac == 1.0;
#else
    up = true;
#endif
    int j = clamp(int(fl) + (up ? 1 : 0), 0, last);
    pc.y.v[e] = pc.x.v[base + uint(j) * pc.inner];
#else
    float acc = 0.0, wsum = 0.0, wsum_all = 0.0;
    for (uint k = 0; k < pc.taps; ++k) {
        int t = pc.tap0 + int(k);
        int j = int(fl) + t;
        float w = kernel_weight((float(t) - frac) * pc.aa);
        wsum_all += w;
#if EXCLUDE
        if (j < 0 || j > last) continue;
#endif
        wsum += w;
        acc += w * pc.x.v[base + uint(clamp(j, 0, last)) * pc.inner];
    }
#if EXCLUDE
    acc = wsum == 0.0 ? acc : acc / wsum;
#else
    if (pc.aa < 1.0) acc /= wsum_all;
#endif
    pc.y.v[e] = acc;
#endif
}
