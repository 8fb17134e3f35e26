#version 450
// Cast from (or, with ENCODE, to) a type narrower than a byte's arithmetic (narrow.glsl says
// which and how they are defined). Decoding goes to float, then to Y's type.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef NBUF  // the narrow side's storage: one byte, or two for bfloat16
#define NBUF U8Buf
#define NT uint8_t
#endif

#if ENCODE
layout(push_constant) uniform Args {
    XBUF x;
    NBUF y;
    uint n;
} pc;
#else
layout(push_constant) uniform Args {
    NBUF x;
    YBUF y;
    uint n;
} pc;
#endif

#include "narrow.glsl"

#if ENCODE
void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    pc.y.v[i] = NT(encode(float(pc.x.v[i])));
}
#else
void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    pc.y.v[i] = YT(YCT(decode(uint(pc.x.v[i]))));
}
#endif
