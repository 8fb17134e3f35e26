#version 450
// CausalConvWithState: a depthwise causal 1-D convolution over the input prefixed with the past
// state (zeros without one). Invocations below NC * L write y[nc, t] = act(bias[c] + sum_k
// w[c, k] * padded[nc, t + k]), the rest the new state: the last K - 1 padded positions.
// X* the element type (float32/float16, computed in float32); ACT 1 applies SiLU.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
#include "elem_math.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    XBUF x;
    XBUF w;
    XBUF bias;   // x when absent (never read then)
    XBUF past;   // x when absent (never read then)
    XBUF y;
    XBUF state;
    uint total;
    uint rows;  // N * C
    uint C;
    uint L;
    uint K;
    uint has_bias;
    uint has_past;
} pc;

// position p of the padded sequence of row nc: K - 1 state values, then the L inputs
float padded(uint nc, uint p) {
    uint lead = pc.K - 1u;
    if (p >= lead) return float(XCT(pc.x.v[nc * pc.L + p - lead]));
    return pc.has_past != 0u ? float(XCT(pc.past.v[nc * lead + p])) : 0.0;
}

void main() {
    uint i = flat_index();
    if (i >= pc.total) return;
    if (i < pc.rows * pc.L) {
        uint nc = i / pc.L, t = i % pc.L, c = nc % pc.C;
        float acc = pc.has_bias != 0u ? float(XCT(pc.bias.v[c])) : 0.0;
        for (uint k = 0; k < pc.K; ++k) acc += float(XCT(pc.w.v[c * pc.K + k])) * padded(nc, t + k);
#if ACT == 1
        acc *= sigmoid_(acc);
#endif
        pc.y.v[i] = XT(XCT(acc));
    } else {
        uint s = i - pc.rows * pc.L, lead = pc.K - 1u;
        uint nc = s / lead, j = s % lead;
        pc.state.v[s] = XT(XCT(padded(nc, pc.L + j)));
    }
}
