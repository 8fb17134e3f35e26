#version 450
// Pad: one invocation per output element; each coordinate maps back into x by MODE
// (0 constant, 1 reflect, 2 edge, 3 wrap). Negative pads crop. HAS_VALUE: the constant is read
// from a tensor (so it may be a graph input), else it is the compile-time FILL (opset < 11).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF x;
    TBUF value;
    TBUF y;
    uint n;
    uint rank;
    uint xshape[6];
    uint yshape[6];
    int begin[6];
} pc;

void main() {
    uint e = flat_index();
    if (e >= pc.n) return;
    uint rem = e, off = 0, st = 1;
    bool outside = false;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        int n = int(pc.xshape[d]);
        int c = int(rem % pc.yshape[d]) - pc.begin[d];
        rem /= pc.yshape[d];
        if (c < 0 || c >= n) {
#if MODE == 0
            outside = true;
#elif MODE == 1
            if (n == 1) {
                c = 0;
            } else {
                int period = 2 * (n - 1);
                c = ((c % period) + period) % period;
                if (c >= n) c = period - c;
            }
#elif MODE == 2
            c = clamp(c, 0, n - 1);
#else
            c = ((c % n) + n) % n;
#endif
        }
        off += uint(c) * st;
        st *= uint(n);
    }
#if HAS_VALUE
    T fill = pc.value.v[0];
#else
    T fill = T(FILL);
#endif
    pc.y.v[e] = outside ? fill : pc.x.v[off];
}
