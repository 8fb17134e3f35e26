#version 450
// Finishes a split-K product: y[i] = alpha * sum_s ws[s][i] + beta * C, over `total`
// elements of rows of `cols`. C's element for i is ((i / cols) % rows) * sCm + (i % cols) * sCn:
// a Gemm bias broadcast by strides, or a convolution's per-channel bias (rows = channels).
// HALF: C and y are float16 (the float16 product's split-K, gemm_f16.py): y rounded once.
// NSPLITS: the split count known when compiled, its loads unrolled so that they are all in flight
// together (the float16 product's; a loop over pc.splits waits for each in turn on a GPU).
// FOLD: a batch of images as one product's columns (gemm.comp's FOLD), FOLD outputs per image:
// element (m, n) goes to output position n % FOLD of channel m of image n / FOLD.
// HAS_RES: a float32 residual of y's layout added before the activation.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "epilogue.glsl"
#if HALF
#include "elem_types.glsl"
#define OBUF F16Buf
#define OT float16_t
#else
#define OBUF F32Buf
#define OT float
#endif
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf ws;
    OBUF c;
    OBUF y;
    uint total, splits, cols, rows, sCm, sCn;
    float alpha, beta;
#if HAS_RES
    F32Buf r;  // a residual of y's layout, added before the activation
#endif
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.total) return;
    float s = 0.0;
#ifdef NSPLITS
    [[unroll]] for (uint k = 0; k < NSPLITS; ++k) s += pc.ws.v[k * pc.total + i];
#else
    for (uint k = 0; k < pc.splits; ++k) s += pc.ws.v[k * pc.total + i];
#endif
    float v = pc.alpha * s;
#if HAS_BIAS
    v += pc.beta * float(pc.c.v[((i / pc.cols) % pc.rows) * pc.sCm + (i % pc.cols) * pc.sCn]);
#endif
#ifdef FOLD
    const uint n = i % pc.cols;
    const uint yi = (n / FOLD * (pc.total / pc.cols) + i / pc.cols) * FOLD + n % FOLD;
#else
    const uint yi = i;
#endif
#if HAS_RES
    v += pc.r.v[yi];
#endif
    pc.y.v[yi] = OT(epilogue(v));
}
