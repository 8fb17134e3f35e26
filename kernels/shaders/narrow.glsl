// Bits of the types narrower than a byte's arithmetic, held one per byte as ml_dtypes and
// onnx.numpy_helper hold them: float8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0fnu), float4 e2m1fn,
// and 4- and 2-bit integers; and bfloat16, two bytes. The including shader defines the type
// (kernels/ops/cast.py _NARROW): FORMAT 0 float with EXP_BITS/MAN_BITS/BIAS, 1 signed integer of
// INT_BITS, 2 unsigned, 3 bfloat16.
// NAN_CODE: 0 IEEE (all-ones exponent: inf or NaN), 1 "fn" (all-ones exponent and mantissa is
// NaN), 2 "fnuz" (0x80 is NaN, no negative zero), 3 none, 4 e8m0 (0xFF is NaN, no sign).
// encode() exists where MAX_VALUE, MAX_CODE and SATURATE are defined too.

#define NAN uintBitsToFloat(0x7fc00000u)
#define INF uintBitsToFloat(0x7f800000u)

float decode(uint b) {
#if FORMAT == 3  // bfloat16: the high half of a float32
    return uintBitsToFloat(b << 16);
#elif FORMAT == 1
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

#ifdef MAX_CODE
// The other way, as ml_dtypes' astype does it: integers truncate toward zero and keep their low
// INT_BITS bits; floats round to nearest even. SATURATE clamps to +-MAX_VALUE first (infinities
// included); otherwise a result past MAX_CODE is the format's overflow: inf for IEEE, NaN for
// fn/fnuz, MAX_CODE for a format with neither (float4 e2m1fn, which also writes NaN as -0).
uint encode(float v) {
#if FORMAT == 3  // bfloat16: round the low half away to nearest even; NaN stays a quiet NaN
    uint u = floatBitsToUint(v);
    if (isnan(v)) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
#elif FORMAT != 0
    return uint(int(v)) & ((1u << INT_BITS) - 1u);
#else
    const uint man_mask = (1u << MAN_BITS) - 1u;
    const uint sign_bit = 1u << (EXP_BITS + MAN_BITS);
    uint sign = (floatBitsToUint(v) >> 31) != 0u ? sign_bit : 0u;
#if NAN_CODE == 0
    const uint nan_bits = sign_bit - 1u - (man_mask >> 1), overflow = sign | (sign_bit - 1u - man_mask);
#elif NAN_CODE == 1
    const uint nan_bits = sign | (sign_bit - 1u), overflow = nan_bits;
#elif NAN_CODE == 2
    const uint nan_bits = sign_bit, overflow = sign_bit;
#else
    const uint nan_bits = sign_bit, overflow = sign | MAX_CODE;
#endif
    if (isnan(v)) return nan_bits;
    float a = abs(v);
#if SATURATE || NAN_CODE == 3
    a = min(a, MAX_VALUE);
#endif
    if (isinf(a)) return overflow;
    const int emin = 1 - BIAS;  // the exponent of the smallest normal
    int e;
    frexp(a, e);  // a = m * 2^e, m in [0.5, 1)
    int E = max(e - 1, emin);
    uint q = uint(roundEven(ldexp(a, MAN_BITS - E)));  // significand with its leading bit
    // q < 2^MAN is a subnormal (E == emin); else a rounding carry may reach 2^(MAN + 1)
    if (q >= (2u << MAN_BITS)) { E += 1; q >>= 1; }
    uint code = q < (1u << MAN_BITS) ? q : (uint(E + BIAS) << MAN_BITS) | (q & man_mask);
    if (code > MAX_CODE) return overflow;
#if NAN_CODE == 2
    if (code == 0u) return 0u;  // no negative zero: its bits are NaN's
#endif
    return sign | code;
#endif
}
#endif
