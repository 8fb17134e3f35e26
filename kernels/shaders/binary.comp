#version 450
// Elementwise y = a (op) b with ONNX multidirectional broadcasting, rank <= 6.
// Broadcast dimensions have stride 0; the output index is decomposed once per element.
// A*/B*/Y* select the element types (kernels/ops/dtypes.py); arithmetic happens in ACT/BCT,
// which are 32- or 64-bit, and the result is converted to the output's storage type.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef AT
#define AT float
#define ABUF F32Buf
#define ACT float
#define AKIND 0
#endif
#ifndef BT
#define BT AT
#define BBUF ABUF
#define BCT ACT
#define BKIND AKIND
#endif
#ifndef YT
#define YT AT
#define YBUF ABUF
#define YCT ACT
#define YKIND AKIND
#endif

layout(push_constant) uniform Args {
    ABUF a;
    BBUF b;
    YBUF y;
    uint n;
    uint rank;
    uint shape[6];
    uint astride[6];
    uint bstride[6];
} pc;

#define NAN uintBitsToFloat(0x7fc00000u)

// x^y on floats. Integer exponents up to 64 go by squaring (a few roundings, exact sign for a
// negative base); the rest through pow(|x|, y), NaN for a negative base.
float pow_(float x, float y) {
    if (y == 0.0) return 1.0;
    if (y == floor(y) && abs(y) <= 64.0) {
        uint e = uint(abs(y));
        float base = x, r = 1.0;
        while (e != 0u) {
            if ((e & 1u) != 0u) r *= base;
            base *= base;
            e >>= 1;
        }
        return y < 0.0 ? 1.0 / r : r;
    }
    if (x < 0.0) {
        if (y != floor(y)) return NAN;
        float r = pow(-x, y);
        return mod(y, 2.0) == 1.0 ? -r : r;
    }
    if (x == 0.0) return y > 0.0 ? 0.0 : 1.0 / 0.0;
    return pow(x, y);
}

// C fmod: the remainder has the sign of x; fma keeps z * trunc(x / z) from rounding.
float fmod_(float x, float z) {
    if (isinf(z) && !isinf(x)) return x;
    return fma(-z, trunc(x / z), x);
}

YCT apply(ACT x, BCT z) {
#if OP == 0
    return x + z;
#elif OP == 1
    return x - z;
#elif OP == 2
    return x * z;
#elif OP == 3  // integer division truncates toward zero (OpSDiv), as ONNX's does
    return x / z;
#elif OP == 4 || OP == 5
#if AKIND == 0
    if (isnan(x) || isnan(z)) return NAN;  // propagate NaN, as numpy's maximum/minimum do
#endif
#if OP == 4
    return max(x, z);
#else
    return min(x, z);
#endif
#elif OP == 6  // Pow: the result has the base's type
#if AKIND == 0
    return pow_(x, float(z));
#elif BKIND == 0
    return ACT(pow_(float(x), z));
#else
    if (z < BCT(0)) return (x == ACT(1)) ? ACT(1) : ACT(0);
    ACT r = ACT(1), base = x;
    BCT e = z;
    while (e != BCT(0)) {
        if ((e & BCT(1)) != BCT(0)) r *= base;
        base *= base;
        e >>= 1;
    }
    return r;
#endif
#elif OP == 7 || OP == 8  // Mod: 7 takes the divisor's sign (Python), 8 the dividend's (C fmod)
#if AKIND == 0
    ACT r = fmod_(x, z);
#if OP == 7
    if (isinf(z) && !isinf(x) && !isnan(x)) return (x == 0.0 || (x < 0.0) == (z < 0.0)) ? x : z;
    if (r != 0.0 && ((r < 0.0) != (z < 0.0))) r += z;
#endif
    return r;
#elif AKIND == 2
    return x % z;
#else
    ACT r = x - (x / z) * z;
#if OP == 7
    if (r != ACT(0) && ((r < ACT(0)) != (z < ACT(0)))) r += z;
#endif
    return r;
#endif
#elif OP == 9
    return (x != 0u && z != 0u) ? 1u : 0u;
#elif OP == 10
    return (x != 0u || z != 0u) ? 1u : 0u;
#elif OP == 11
    return ((x != 0u) != (z != 0u)) ? 1u : 0u;
#elif OP == 12
    return x == z ? 1u : 0u;
#elif OP == 13
    return x < z ? 1u : 0u;
#elif OP == 14
    return x > z ? 1u : 0u;
#elif OP == 15
    return x <= z ? 1u : 0u;
#elif OP == 16
    return x >= z ? 1u : 0u;
#elif OP == 17  // PRelu: b is the slope
    return x < ACT(0) ? x * z : x;
#elif OP == 18 || OP == 19  // BitShift left / right; narrow types shift in 32 bits, wrap on store
    // a count outside [0, BITS) shifts every bit out: 0, or -1 for a negative value shifted
    // right (the sign fills it), as numpy does; GLSL leaves such counts undefined
    if (z < BCT(0) || z >= BCT(BITS)) {
#if OP == 18
        return ACT(0);
#else
        return x < ACT(0) ? ACT(-1) : ACT(0);
#endif
    }
#if OP == 18
    return x << z;
#else
    return x >> z;  // arithmetic for signed types
#endif
#elif OP == 20
    return x & z;
#elif OP == 21
    return x | z;
#elif OP == 22
    return x ^ z;
#else
#error "unknown OP"
#endif
}

void main() {
    uint i = flat_index();
#if !EXACT  // EXACT (CPU-like devices): the grid holds exactly n invocations, no bounds test needed
    if (i >= pc.n) return;
#endif
#if FLAT  // both inputs of the output's shape (CPU-like devices: no division per element)
    uint ia = i, ib = i;
#else
    uint ia = 0, ib = 0, rem = i;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        uint c = rem % pc.shape[d];
        rem /= pc.shape[d];
        ia += c * pc.astride[d];
        ib += c * pc.bstride[d];
    }
#endif
#if RELU  // a Relu folded into the op (vkpool.fusion): v < 0 keeps NaN, as the Relu op does
    YCT v = apply(ACT(pc.a.v[ia]), BCT(pc.b.v[ib]));
    pc.y.v[i] = YT(v < YCT(0) ? YCT(0) : v);
#else
    pc.y.v[i] = YT(apply(ACT(pc.a.v[ia]), BCT(pc.b.v[ib])));
#endif
}
