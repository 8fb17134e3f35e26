#version 450
// NegativeLogLikelihoodLoss of x[N, C, D] (D: the product of the trailing dims) and integer
// targets t[N, D]: loss[n, d] = -x[n, t, d] * w[t], and 0 where t is the ignored index.
// MODE 0 writes every loss to y[N, D] (reduction "none"). MODE 1 and 2 run one workgroup that
// writes y[0]: the sum of the losses (1), or their mean weighted by w[t] over the targets not
// ignored (2). Targets outside [0, C) are clamped so that no load leaves the tensors.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    TBUF t;
    F32Buf w;  // x itself when there are no weights (never read then)
    F32Buf y;
    uint N;
    uint C;
    uint D;
    uint has_weight;
    uint has_ignore;
    int ignore_index;
} pc;

// the loss of element i of the targets, and the weight it counts with in a mean
vec2 loss_at(uint i) {
    TCT target = TCT(pc.t.v[i]);
    if (pc.has_ignore != 0u && target == TCT(pc.ignore_index)) return vec2(0.0);
    uint c = uint(clamp(target, TCT(0), TCT(pc.C - 1u)));
    float weight = pc.has_weight != 0u ? pc.w.v[c] : 1.0;
    uint n = i / pc.D, d = i % pc.D;
    return vec2(-pc.x.v[(n * pc.C + c) * pc.D + d] * weight, weight);
}

#if MODE == 0
void main() {
    uint i = flat_index();
    if (i >= pc.N * pc.D) return;
    pc.y.v[i] = loss_at(i).x;
}
#else
shared vec2 part[LOCAL_SIZE];

void main() {
    const uint lane = gl_LocalInvocationID.x;
    vec2 acc = vec2(0.0);
    for (uint i = lane; i < pc.N * pc.D; i += LOCAL_SIZE) acc += loss_at(i);
    part[lane] = acc;
    barrier();
    for (uint s = LOCAL_SIZE / 2; s > 0; s >>= 1) {
        if (lane < s) part[lane] += part[lane + s];
        barrier();
    }
    if (lane == 0u) pc.y.v[0] = MODE == 1 ? part[0].x : part[0].x / part[0].y;
}
#endif
