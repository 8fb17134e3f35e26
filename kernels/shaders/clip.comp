#version 450
// y = min(max(x, lo), hi) on any numeric type. LO_MODE/HI_MODE: 0 no bound, 1 the bound is a
// push constant (known at load time), 2 it is read from a one-element tensor.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    XBUF x;
    XBUF y;
    XBUF lo_ptr;
    XBUF hi_ptr;
    uint n;
    XCT lo;
    XCT hi;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    XCT v = XCT(pc.x.v[i]);
    // comparisons rather than min/max keep a NaN input NaN
#if LO_MODE == 1
    v = v < pc.lo ? pc.lo : v;
#elif LO_MODE == 2
    XCT lo = XCT(pc.lo_ptr.v[0]);
    v = v < lo ? lo : v;
#endif
#if HI_MODE == 1
    v = v > pc.hi ? pc.hi : v;
#elif HI_MODE == 2
    XCT hi = XCT(pc.hi_ptr.v[0]);
    v = v > hi ? hi : v;
#endif
    pc.y.v[i] = XT(v);
}
