#version 450
// present = concat(past, new) along the sequence axis, present/past [B, H, *, DIM];
// NEW3D: new is [B, L, H*DIM] (else [B, H, L, DIM]). PAST may be 0 (present is new, 4-D).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    F32Buf past;
    F32Buf new_;
    F32Buf present;
} pc;

void main() {
    uint e = flat_index();
    const uint TT = PAST + L;
    if (e >= B * H * TT * DIM) return;
    uint d = e % DIM, t = (e / DIM) % TT, h = (e / (DIM * TT)) % H, b = e / (DIM * TT * H);
    float val;
    if (t < PAST) {
        val = pc.past.v[((b * H + h) * PAST + t) * DIM + d];
    } else {
        uint j = t - PAST;
#if NEW3D
        val = pc.new_.v[((b * L + j) * H + h) * DIM + d];
#else
        val = pc.new_.v[((b * H + h) * L + j) * DIM + d];
#endif
    }
    pc.present.v[e] = val;
}
