#version 450
// Elementwise y = a (op) b with ONNX multidirectional broadcasting, rank <= 6.
// Broadcast dimensions have stride 0; the output index is decomposed once per element.
// T/TBUF select the element type (float: F32Buf, int64: I64Buf).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef T
#define T float
#define TBUF F32Buf
#endif

layout(push_constant) uniform Args {
    TBUF a;
    TBUF b;
    TBUF y;
    uint n;
    uint rank;
    uint shape[6];
    uint astride[6];
    uint bstride[6];
} pc;

T apply(T x, T z) {
#if OP == 0
    return x + z;
#elif OP == 1
    return x - z;
#elif OP == 2
    return x * z;
#elif OP == 3
    return x / z;
#elif OP == 4
    return max(x, z);
#elif OP == 5
    return min(x, z);
#else
#error "unknown OP"
#endif
}

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint ia = 0, ib = 0, rem = i;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        uint c = rem % pc.shape[d];
        rem /= pc.shape[d];
        ia += c * pc.astride[d];
        ib += c * pc.bstride[d];
    }
    pc.y.v[i] = apply(pc.a.v[ia], pc.b.v[ib]);
}
