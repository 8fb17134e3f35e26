#version 450
// Cast from a type narrower than a byte's arithmetic: float8 (e4m3fn, e4m3fnuz, e5m2,
// e5m2fnuz, e8m0fnu), float4 e2m1fn, and 4- and 2-bit integers, each stored one per byte (as
// ml_dtypes and onnx.numpy_helper hold them). The bits are decoded to float, then converted to
// Y's type. FORMAT: 0 float with EXP_BITS/MAN_BITS/BIAS, 1 signed integer of INT_BITS, 2 unsigned.
// NAN_CODE: 0 IEEE (all-ones exponent: inf or NaN), 1 "fn" (all-ones exponent and mantissa is
// NaN), 2 "fnuz" (0x80 is NaN, no negative zero), 3 none, 4 e8m0 (0xFF is NaN, no sign).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    U8Buf x;
    YBUF y;
    uint n;
} pc;

#define NAN uintBitsToFloat(0x7fc00000u)
#define INF uintBitsToFloat(0x7f800000u)

float decode(uint b) {
#if FORMAT == 1
    return float(int(b << (32 - INT_BITS)) >> (32 - INT_BITS));  // sign-extend
#elif FORMAT == 2
    return float(b & ((1u << INT_BITS) - 1u));
#elif NAN_CODE == 4
    return b == 0xFFu ? NAN : ldexp(1.0, int(b) - 127);
#else
    const uint man_mask = (1u << MAN_BITS) - 1u, exp_mask = (1u << EXP_BITS) - 1u;
    const uint sign_bit = 1u << (EXP_BITS + MAN_BITS);
    uint e = (b >> MAN_BITS) & exp_mask, f = b & man_mask;
    float s = (b & sign_bit) != 0u ? -1.0 : 1.0;
#if NAN_CODE == 0
    if (e == exp_mask) return f == 0u ? s * INF : NAN;
#elif NAN_CODE == 1
    if (e == exp_mask && f == man_mask) return NAN;
#elif NAN_CODE == 2
    if (b == sign_bit) return NAN;
#endif
    if (e == 0u) return s * ldexp(float(f), 1 - BIAS - MAN_BITS);  // subnormal
    return s * ldexp(1.0 + float(f) / float(1u << MAN_BITS), int(e) - BIAS);
#endif
}

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    pc.y.v[i] = YT(YCT(decode(uint(pc.x.v[i]))));
}
