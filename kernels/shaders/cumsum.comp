#version 450
// CumSum (CumProd with PROD) along an axis read from the device at run time (so the axis may
// be a graph input): one invocation per line of the axis, serial along it.
// EXCLUSIVE and REVERSE are the ONNX attributes; AXIS_T/AXIS_BUF: the axis tensor's type.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    AXIS_TBUF axis;
    TBUF y;
    uint total;
    uint rank;
    uint shape[6];
} pc;

void main() {
    uint line = flat_index();
    int a = int(pc.axis.v[0]);
    if (a < 0) a += int(pc.rank);
    uint n = pc.shape[a];
    uint inner = 1;
    for (uint d = uint(a) + 1; d < pc.rank; ++d) inner *= pc.shape[d];
    if (n == 0 || line >= pc.total / n) return;
    uint base = (line / inner) * n * inner + line % inner;
#if PROD  // CumProd
    T acc = T(1);
#define ACCUMULATE(v) acc *= v
#else
    T acc = T(0);
#define ACCUMULATE(v) acc += v
#endif
    for (uint k = 0; k < n; ++k) {
#if REVERSE
        uint i = base + (n - 1 - k) * inner;
#else
        uint i = base + k * inner;
#endif
        T v = pc.x.v[i];
#if EXCLUSIVE
        pc.y.v[i] = acc;
        ACCUMULATE(v);
#else
        ACCUMULATE(v);
        pc.y.v[i] = acc;
#endif
    }
}
