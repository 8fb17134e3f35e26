#version 450
// CumSum (CumProd with PROD) along an axis read from the device at run time (so the axis may
// be a graph input): one invocation per line of the axis, serial along it over the positions
// start .. start+count-1 of the line. A long axis runs as several dispatches of such pieces (a
// device may bound the loop iterations of one invocation); a piece after the first continues from
// what the previous piece wrote, so the sums are those of one serial pass, bit for bit.
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
    uint start;
    uint count;
} pc;

void main() {
    uint line = flat_index();
    int a = int(pc.axis.v[0]);
    if (a < 0) a += int(pc.rank);
    uint n = pc.shape[a];
    uint inner = 1;
    for (uint d = uint(a) + 1; d < pc.rank; ++d) inner *= pc.shape[d];
    // a piece past a run-time axis's extent (pieces cover the longest dim) has nothing to do
    if (n == 0 || line >= pc.total / n || pc.start >= n) return;
    uint base = (line / inner) * n * inner + line % inner;
#if PROD  // CumProd
    T acc = T(1);
#define ACCUMULATE(v) acc *= v
#else
    T acc = T(0);
#define ACCUMULATE(v) acc += v
#endif
#if REVERSE
#define AT(k) (base + (n - 1 - (k)) * inner)
#else
#define AT(k) (base + (k) * inner)
#endif
    if (pc.start > 0) {
        uint before = AT(pc.start - 1);
        acc = pc.y.v[before];
#if EXCLUSIVE
        ACCUMULATE(pc.x.v[before]);
#endif
    }
    for (uint k = pc.start; k < min(n, pc.start + pc.count); ++k) {
        uint i = AT(k);
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
