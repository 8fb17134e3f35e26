#version 450
// BatchNormalization, inference: y = (x - mean[p]) / sqrt(var[p] + eps) * scale[p] + b[p],
// with p = (i / S) % C: S = spatial size per channel (1 and C = channels x spatial for the
// per-element parameters of opset < 9 with spatial = 0).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf scale;
    F32Buf bias;
    F32Buf mean;
    F32Buf var;
    F32Buf y;
    uint n;
    uint S;
    uint C;
    float eps;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint p = (i / pc.S) % pc.C;
    float inv = pc.scale.v[p] / sqrt(pc.var.v[p] + pc.eps);
    pc.y.v[i] = (pc.x.v[i] - pc.mean.v[p]) * inv + pc.bias.v[p];
}
