#version 450
// RotaryEmbedding: one invocation per output element of x, seen as [B, S, H, D] (X3D: x is
// [B, S, H*D], else [B, H, S, D]). The first RD features rotate in pairs (INTERLEAVED: (2i, 2i+1),
// else (i, i + RD/2)) by the cos/sin of the position (POS: position_ids[b, s] row of the
// caches, else the caches are [B, S, RD/2]); the rest pass through.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf cos_cache;
    F32Buf sin_cache;
    I64Buf pos;
    F32Buf y;
} pc;

void main() {
    uint e = flat_index();
    if (e >= NB * NS * NH * ND) return;
    uint d = e % ND;
#if X3D
    uint h = (e / ND) % NH, s = (e / (ND * NH)) % NS;
#else
    uint s = (e / ND) % NS, h = (e / (ND * NS)) % NH;
#endif
    uint b = e / (ND * NS * NH);
    if (d >= RD) {
        pc.y.v[e] = pc.x.v[e];
        return;
    }
    const uint HALF = RD / 2;
#if POS
    uint crow = uint(pc.pos.v[b * NS + s]) * HALF;
#else
    uint crow = (b * NS + s) * HALF;
#endif
    uint head = e - d;  // element 0 of this head's feature vector
#if INTERLEAVED
    uint i = d / 2;
    float x1 = pc.x.v[head + 2 * i], x2 = pc.x.v[head + 2 * i + 1];
    bool first = (d % 2) == 0;
#else
    uint i = d % HALF;
    float x1 = pc.x.v[head + i], x2 = pc.x.v[head + i + HALF];
    bool first = d < HALF;
#endif
    float c = pc.cos_cache.v[crow + i], sn = pc.sin_cache.v[crow + i];
    pc.y.v[e] = first ? c * x1 - sn * x2 : sn * x1 + c * x2;
}
