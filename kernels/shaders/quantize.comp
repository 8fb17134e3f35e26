#version 450
// DequantizeLinear (MODE 0): y = (x - zero_point) * scale; QuantizeLinear (MODE 1):
// y = saturate(roundEven(x / scale) + zero_point), or for float8/float4 the nearest value (with
// SATURATE's clamping). Scale and zero point are per tensor, per axis or per block: element
// (o, a, k) of x viewed as [outer, A, inner] takes parameter o * so + (a / block) * sa + k * sk.
// Q*: the quantized side (DQ's x, Q's y, the zero point); with NARROW it is one of narrow.glsl's
// types held one per byte. F*: the float side (Q's x, DQ's y); S*: the scale.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#if MODE == 0
#define IN_BUF QBUF
#define OUT_BUF FBUF
#else
#define IN_BUF FBUF
#define OUT_BUF QBUF
#endif

layout(push_constant) uniform Args {
    IN_BUF x;
    SBUF scale;
    QBUF zero;  // x itself when there is no zero point (never read then)
    OUT_BUF y;
    uint n;
    uint A;
    uint inner;
    uint block;
    uint so;
    uint sa;
    uint sk;
    uint has_zero;
} pc;

#if NARROW
#include "narrow.glsl"
float q_value(QBUF b, uint i) { return decode(uint(b.v[i])); }
#else
float q_value(QBUF b, uint i) { return float(QCT(b.v[i])); }
#endif

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint k = i % pc.inner, a = (i / pc.inner) % pc.A, o = i / (pc.inner * pc.A);
    uint p = o * pc.so + (a / pc.block) * pc.sa + k * pc.sk;
    float zero = pc.has_zero != 0u ? q_value(pc.zero, p) : 0.0;
    float scale = float(pc.scale.v[p]);
#if MODE == 0
    pc.y.v[i] = FT((q_value(pc.x, i) - zero) * scale);
#else
    float v = div_rn(float(pc.x.v[i]), scale);
#if NARROW && FORMAT == 0
    pc.y.v[i] = uint8_t(encode(v + zero));
#else
    float r = clamp(roundEven(v) + zero, QMIN, QMAX);
#if NARROW
    pc.y.v[i] = uint8_t(uint(int(r)) & ((1u << INT_BITS) - 1u));
#else
    pc.y.v[i] = QT(QCT(r));
#endif
#endif
#endif
}
