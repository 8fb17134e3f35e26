#version 450
// LRN across channels: y = x / (bias + alpha / SIZE * sum of x^2 over the channel window
// [c - (SIZE - 1) / 2, c + ceil((SIZE - 1) / 2)]) ^ beta; C channels of S elements each.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf y;
    uint n;
    uint S;
    uint C;
    float alpha;
    float beta;
    float bias;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    int c = int((i / pc.S) % pc.C);
    uint plane0 = i - uint(c) * pc.S;  // element i in channel 0
    int lo = max(0, c - (SIZE - 1) / 2);
    int hi = min(int(pc.C) - 1, c + SIZE / 2);
    float sq = 0.0;
    for (int k = lo; k <= hi; ++k) {
        float v = pc.x.v[plane0 + uint(k) * pc.S];
        sq = fma(v, v, sq);
    }
    pc.y.v[i] = pc.x.v[i] / pow(pc.bias + pc.alpha / float(SIZE) * sq, pc.beta);
}
