#version 450
// Elementwise y = f(x). OP selects f; ALPHA/BETA/GAMMA arrive as push constants.
// X*/Y* select the element types (kernels/ops/dtypes.py); f computes in XCT/YCT, which are
// 32- or 64-bit, so narrow types are only loaded and stored.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
#include "elem_math.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef XT
#define XT float
#define XBUF F32Buf
#define XCT float
#define XKIND 0
#endif
#ifndef YT
#define YT XT
#define YBUF XBUF
#define YCT XCT
#define YKIND XKIND
#endif

layout(push_constant) uniform Args {
    XBUF x;
    YBUF y;
    uint n;
    float alpha;
    float beta;
    float gamma;
} pc;

YCT apply(XCT v) {
#if OP == 0     // Relu (v < 0 keeps NaN, as numpy's maximum does)
    return v < XCT(0) ? XCT(0) : v;
#elif OP == 1   // LeakyRelu
    return v >= 0.0 ? v : pc.alpha * v;
#elif OP == 2   // Sigmoid
    return sigmoid_(v);
#elif OP == 3   // Tanh
    return tanh_(v);
#elif OP == 4   // Scale (Mean's final division)
    return v * pc.alpha;
#elif OP == 5   // Cast: C conversions; to bool is "not zero"
#if YKIND == 3
    return v != XCT(0) ? 1u : 0u;
#elif XKIND == 0 && YKIND == 2
    // float to unsigned through a signed 64-bit integer: a negative value wraps as numpy's
    // and C's conversions do in practice, rather than saturating to 0 or the maximum
    return YCT(int64_t(v));
#else
    return YCT(v);
#endif
#elif OP == 6   // Sqrt
    return sqrt(v);
#elif OP == 7   // Exp
    return exp(v);
#elif OP == 8   // Log
    return log(v);
#elif OP == 9   // Abs
#if XKIND == 2
    return v;
#else
    return abs(v);
#endif
#elif OP == 10  // Neg
    return -v;
#elif OP == 11  // Reciprocal
    return 1.0 / v;
#elif OP == 12  // Floor
    return floor(v);
#elif OP == 13  // Ceil
    return ceil(v);
#elif OP == 14  // Round: half to even
    return roundEven(v);
#elif OP == 15  // Sign
#if XKIND == 0
    return sign(v);
#else
    return v > XCT(0) ? XCT(1) : (v == XCT(0) ? XCT(0) : XCT(-1));
#endif
#elif OP == 16  // Sin
    return sin(v);
#elif OP == 17  // Cos
    return cos(v);
#elif OP == 18  // Erf
    return erf_(v);
#elif OP == 19  // Gelu, exact
    return 0.5 * v * (1.0 + erf_(v * 0.70710678118654752));
#elif OP == 20  // Gelu, tanh approximation
    return 0.5 * v * (1.0 + tanh_(0.79788456080286536 * (v + 0.044715 * v * v * v)));
#elif OP == 21  // Elu
    return v < 0.0 ? pc.alpha * (exp(v) - 1.0) : v;
#elif OP == 22  // Selu (alpha, gamma)
    return v > 0.0 ? pc.gamma * v : pc.gamma * (pc.alpha * exp(v) - pc.alpha);
#elif OP == 23  // Celu
    return max(v, 0.0) + min(0.0, pc.alpha * (exp(v / pc.alpha) - 1.0));
#elif OP == 24  // HardSigmoid
    return clamp(pc.alpha * v + pc.beta, 0.0, 1.0);
#elif OP == 25  // HardSwish
    return v * clamp(v / 6.0 + 0.5, 0.0, 1.0);
#elif OP == 26  // Softplus
    return softplus_(v);
#elif OP == 27  // Softsign
    return v / (1.0 + abs(v));
#elif OP == 28  // Mish
    return v * tanh_(softplus_(v));
#elif OP == 29  // Swish
    return v * sigmoid_(pc.alpha * v);
#elif OP == 30  // ThresholdedRelu
    return v > pc.alpha ? v : 0.0;
#elif OP == 31  // Shrink (lambd, bias), any numeric type
    float f = float(v);
    return f < -pc.alpha ? XCT(f + pc.beta) : (f > pc.alpha ? XCT(f - pc.beta) : XCT(0));
#elif OP == 32  // IsNaN
    return isnan(v) ? 1u : 0u;
#elif OP == 33  // IsInf (alpha: detect_negative, beta: detect_positive)
    return (isinf(v) && ((v < 0.0 && pc.alpha != 0.0) || (v > 0.0 && pc.beta != 0.0))) ? 1u : 0u;
#elif OP == 34  // Not
    return v != 0u ? 0u : 1u;
#elif OP == 35  // BitwiseNot, any integer type (narrow ones wrap on store)
    return ~v;
#elif OP == 36  // Tan
    return tan(v);
#elif OP == 37  // Asin
    return asin_(v);
#elif OP == 38  // Acos
    return acos_(v);
#elif OP == 39  // Atan
    return atan(v);
#elif OP == 40  // Sinh: e^x/2 - e^-x/2 cancels near 0, where the series is exact to float
    return abs(v) < 0.0625 ? v * (1.0 + v * v * (1.0 / 6.0 + v * v / 120.0)) : 0.5 * (exp(v) - exp(-v));
#elif OP == 41  // Cosh
    return 0.5 * (exp(v) + exp(-v));
#elif OP == 42  // Asinh = sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2))), exact near 0
    float a = abs(v);
    float r = a > 1e18 ? log(a) + 0.69314718056 : log1p_(a + a * a / (1.0 + sqrt(1.0 + a * a)));
    return v < 0.0 ? -r : r;
#elif OP == 43  // Acosh
    return log(v + sqrt(v * v - 1.0));
#elif OP == 44  // Atanh = log1p(2x / (1 - x)) / 2, exact near 0
    return 0.5 * log1p_(2.0 * v / (1.0 - v));
#else
#error "unknown OP"
#endif
}

void main() {
    uint i = flat_index();
#if !EXACT  // EXACT (CPU-like devices): the grid holds exactly n invocations, no bounds test needed
    if (i >= pc.n) return;
#endif
    pc.y.v[i] = YT(apply(XCT(pc.x.v[i])));
}
