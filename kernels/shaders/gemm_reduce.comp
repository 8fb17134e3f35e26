#version 450
// Finishes a split-K product: y[i] = alpha * sum_s ws[s][i] + beta * C, over `total`
// elements of rows of `cols`. C's element for i is ((i / cols) % rows) * sCm + (i % cols) * sCn:
// a Gemm bias broadcast by strides, or a convolution's per-channel bias (rows = channels).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "epilogue.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf ws;
    F32Buf c;
    F32Buf y;
    uint total, splits, cols, rows, sCm, sCn;
    float alpha, beta;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.total) return;
    float s = 0.0;
    for (uint k = 0; k < pc.splits; ++k) s += pc.ws.v[k * pc.total + i];
    float v = pc.alpha * s;
#if HAS_BIAS
    v += pc.beta * pc.c.v[((i / pc.cols) % pc.rows) * pc.sCm + (i % pc.cols) * pc.sCn];
#endif
    v = epilogue(v);
    pc.y.v[i] = v;
}
