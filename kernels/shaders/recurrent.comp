#version 450
// RNN (CELL 0), GRU (1) and LSTM (2) with the default activations. One workgroup per (direction,
// batch row), one invocation per hidden unit (H <= LOCAL_SIZE); the state lives in shared memory
// and every step ends at a barrier. Time runs backwards for direction 1 of a reverse or
// bidirectional op (REVERSE_FIRST makes direction 0 reverse); steps at and past the row's
// sequence length write zeros to Y and leave the state alone. Weights are ONNX's: W [dirs, G*H,
// I], R [dirs, G*H, H], B [dirs, 2*G*H], peepholes P [dirs, 3*H]; gate order RNN h, GRU z r h,
// LSTM i o f c. LAYOUT 1 puts the batch first in X, Y, Y_h and Y_c.
//
// STEPWISE 1 is the same recurrence for a hidden size past one workgroup, or a sequence whose
// steps would run more loop iterations in one invocation than the device completes: one dispatch
// per step (two for GRU), one invocation per (direction, batch row, unit), the state in the
// workspace ws: h twice (read one, write the other, by the step's parity), then c, then GRU's
// r * h. PHASE 0 loads the initial state, 1 is a step, 2 GRU's reset gate of a step, 3 writes
// Y_h and Y_c.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_math.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    F32Buf w;
    F32Buf r;
    F32Buf b;       // x when absent (HAS_B 0)
    I32Buf lens;    // x when absent (HAS_LENS 0)
    F32Buf h0;      // x when absent (HAS_H0 0)
    F32Buf c0;      // x when absent (HAS_C0 0)
    F32Buf p;       // x when absent (HAS_P 0)
    F32Buf y;       // x when not wanted (HAS_Y 0)
    F32Buf yh;      // x when not wanted (HAS_YH 0)
    F32Buf yc;      // x when not wanted (HAS_YC 0)
    F32Buf ws;      // STEPWISE: the state; x otherwise
    uint S;         // sequence length
    uint N;         // batch
    uint I;         // input size
    uint H;         // hidden size
    uint dirs;
    float clip;     // 0: no clipping
    uint step;      // STEPWISE: the step of this dispatch
    uint phase;     // STEPWISE: see above
} pc;

#if CELL == 0
#define G 1
#elif CELL == 1
#define G 3
#else
#define G 4
#endif

#if STEPWISE
// hrow / rrow: where this row's state / GRU reset values start in ws
#define STATE(k) pc.ws.v[hrow + (k)]
#define RESET(k) pc.ws.v[rrow + (k)]
#else
shared float h[LOCAL_SIZE];
shared float reset_h[LOCAL_SIZE];  // GRU: r * h, or r for linear_before_reset
#define STATE(k) h[k]
#define RESET(k) reset_h[k]
#endif

float clipped(float v) { return pc.clip > 0.0 ? clamp(v, -pc.clip, pc.clip) : v; }

// x_t W_g^T + W bias of unit j, gate g
float input_part(uint d, uint g, uint j, uint xrow) {
    float acc = HAS_B != 0 ? pc.b.v[d * 2u * G * pc.H + g * pc.H + j] : 0.0;
    uint wrow = (d * G + g) * pc.H + j;
    for (uint i = 0; i < pc.I; ++i) acc += pc.x.v[xrow + i] * pc.w.v[wrow * pc.I + i];
    return acc;
}

// s R_g^T + R bias of unit j, gate g, for a state s in shared memory
float state_part(uint d, uint g, uint j, bool reset, uint hrow, uint rrow) {
    float acc = HAS_B != 0 ? pc.b.v[d * 2u * G * pc.H + (G + g) * pc.H + j] : 0.0;
    uint wrow = ((d * G + g) * pc.H + j) * pc.H;
    for (uint k = 0; k < pc.H; ++k) acc += (reset ? RESET(k) : STATE(k)) * pc.r.v[wrow + k];
    return acc;
}

// Where the initial and final states of unit j of row (d, n) live in h0, c0, Y_h and Y_c.
uint state_index(uint d, uint n, uint j) {
#if LAYOUT == 0
    return (d * pc.N + n) * pc.H + j;
#else
    return (n * pc.dirs + d) * pc.H + j;
#endif
}

#if STEPWISE
void main() {
    const uint idx = flat_index();
    const uint plane = pc.dirs * pc.N * pc.H;
    if (idx >= plane) return;
    const uint j = idx % pc.H, row = idx / pc.H, n = row % pc.N, d = row / pc.N;
    const uint state_at = state_index(d, n, j);
    const uint cur = (pc.step & 1u) * plane, cat = 2u * plane + idx;
    if (pc.phase == 0u) {
        pc.ws.v[idx] = HAS_H0 != 0 ? pc.h0.v[state_at] : 0.0;
        pc.ws.v[cat] = HAS_C0 != 0 ? pc.c0.v[state_at] : 0.0;
        return;
    }
    if (pc.phase == 3u) {  // step is the sequence length: its parity names the last state written
#if HAS_YH
        pc.yh.v[state_at] = pc.ws.v[cur + idx];
#endif
#if HAS_YC
        pc.yc.v[state_at] = pc.ws.v[cat];
#endif
        return;
    }
    const uint hrow = cur + row * pc.H, rrow = 3u * plane + row * pc.H;
    const bool backwards = (d == 1u) != (REVERSE_FIRST != 0);
    const uint len = HAS_LENS != 0 ? min(uint(pc.lens.v[n]), pc.S) : pc.S;
    const uint step = pc.step;
    const uint t = backwards ? (step < len ? len - 1u - step : step) : step;
    const bool live = t < len;
#if LAYOUT == 0
    const uint xrow = (t * pc.N + n) * pc.I;
    const uint yat = ((t * pc.dirs + d) * pc.N + n) * pc.H + j;
#else
    const uint xrow = (n * pc.S + t) * pc.I;
    const uint yat = ((n * pc.S + t) * pc.dirs + d) * pc.H + j;
#endif
    const float hj = STATE(j);
#if CELL == 1
    if (pc.phase == 2u) {
        if (live) {
            float rg = sigmoid_(clipped(input_part(d, 1u, j, xrow) + state_part(d, 1u, j, false, hrow, rrow)));
            RESET(j) = LINEAR_BEFORE_RESET != 0 ? rg : rg * hj;
        }
        return;
    }
#endif
    float next = hj, c = pc.ws.v[cat];
    if (live) {
#if CELL == 0
        next = tanh_(clipped(input_part(d, 0u, j, xrow) + state_part(d, 0u, j, false, hrow, rrow)));
#elif CELL == 1
        float z = sigmoid_(clipped(input_part(d, 0u, j, xrow) + state_part(d, 0u, j, false, hrow, rrow)));
#if LINEAR_BEFORE_RESET
        float hh = tanh_(clipped(input_part(d, 2u, j, xrow) + RESET(j) * state_part(d, 2u, j, false, hrow, rrow)));
#else
        float hh = tanh_(clipped(input_part(d, 2u, j, xrow) + state_part(d, 2u, j, true, hrow, rrow)));
#endif
        next = (1.0 - z) * hh + z * hj;
#else
        float pi = HAS_P != 0 ? pc.p.v[d * 3u * pc.H + j] : 0.0;
        float po = HAS_P != 0 ? pc.p.v[d * 3u * pc.H + pc.H + j] : 0.0;
        float pf = HAS_P != 0 ? pc.p.v[d * 3u * pc.H + 2u * pc.H + j] : 0.0;
        float ig = sigmoid_(clipped(input_part(d, 0u, j, xrow) + state_part(d, 0u, j, false, hrow, rrow) + pi * c));
        float fg = sigmoid_(clipped(input_part(d, 2u, j, xrow) + state_part(d, 2u, j, false, hrow, rrow) + pf * c));
        float cc = tanh_(clipped(input_part(d, 3u, j, xrow) + state_part(d, 3u, j, false, hrow, rrow)));
        c = fg * c + ig * cc;
        float og = sigmoid_(clipped(input_part(d, 1u, j, xrow) + state_part(d, 1u, j, false, hrow, rrow) + po * c));
        next = og * tanh_(c);
#endif
    }
    pc.ws.v[plane - cur + idx] = next;
    pc.ws.v[cat] = c;
#if HAS_Y
    pc.y.v[yat] = live ? next : 0.0;
#endif
}
#else

void main() {
    const uint g = flat_group();
    if (g >= pc.dirs * pc.N) return;  // a folded grid's spare workgroups: uniform over the workgroup
    const uint d = g / pc.N, n = g % pc.N, j = gl_LocalInvocationID.x;
    const bool unit = j < pc.H;
    const bool backwards = (d == 1u) != (REVERSE_FIRST != 0);
    const uint len = HAS_LENS != 0 ? min(uint(pc.lens.v[n]), pc.S) : pc.S;
    const uint state_at = state_index(d, n, j);
    const uint hrow = 0u, rrow = 0u;  // the state is the workgroup's shared memory
    float c = 0.0;
    if (unit) {
        h[j] = HAS_H0 != 0 ? pc.h0.v[state_at] : 0.0;
        c = HAS_C0 != 0 ? pc.c0.v[state_at] : 0.0;
    }
    barrier();
    for (uint step = 0; step < pc.S; ++step) {
        uint t = backwards ? (step < len ? len - 1u - step : step) : step;
        bool live = t < len;
#if LAYOUT == 0
        uint xrow = (t * pc.N + n) * pc.I;
        uint yat = ((t * pc.dirs + d) * pc.N + n) * pc.H + j;
#else
        uint xrow = (n * pc.S + t) * pc.I;
        uint yat = ((n * pc.S + t) * pc.dirs + d) * pc.H + j;
#endif
        float next = 0.0;
#if CELL == 0
        if (unit && live) next = tanh_(clipped(input_part(d, 0u, j, xrow) + state_part(d, 0u, j, false, hrow, rrow)));
#elif CELL == 1
        float z = 0.0;
        if (unit && live) {
            z = sigmoid_(clipped(input_part(d, 0u, j, xrow) + state_part(d, 0u, j, false, hrow, rrow)));
            float rg = sigmoid_(clipped(input_part(d, 1u, j, xrow) + state_part(d, 1u, j, false, hrow, rrow)));
            reset_h[j] = LINEAR_BEFORE_RESET != 0 ? rg : rg * h[j];
        }
        barrier();
        if (unit && live) {
#if LINEAR_BEFORE_RESET
            float hh = tanh_(clipped(input_part(d, 2u, j, xrow) + reset_h[j] * state_part(d, 2u, j, false, hrow, rrow)));
#else
            float hh = tanh_(clipped(input_part(d, 2u, j, xrow) + state_part(d, 2u, j, true, hrow, rrow)));
#endif
            next = (1.0 - z) * hh + z * h[j];
        }
#else
        if (unit && live) {
            float pi = HAS_P != 0 ? pc.p.v[d * 3u * pc.H + j] : 0.0;
            float po = HAS_P != 0 ? pc.p.v[d * 3u * pc.H + pc.H + j] : 0.0;
            float pf = HAS_P != 0 ? pc.p.v[d * 3u * pc.H + 2u * pc.H + j] : 0.0;
            float ig = sigmoid_(clipped(input_part(d, 0u, j, xrow) + state_part(d, 0u, j, false, hrow, rrow) + pi * c));
            float fg = sigmoid_(clipped(input_part(d, 2u, j, xrow) + state_part(d, 2u, j, false, hrow, rrow) + pf * c));
            float cc = tanh_(clipped(input_part(d, 3u, j, xrow) + state_part(d, 3u, j, false, hrow, rrow)));
            c = fg * c + ig * cc;
            float og = sigmoid_(clipped(input_part(d, 1u, j, xrow) + state_part(d, 1u, j, false, hrow, rrow) + po * c));
            next = og * tanh_(c);
        }
#endif
        barrier();  // every unit has read the old state
        if (unit) {
            if (live) h[j] = next;
#if HAS_Y
            pc.y.v[yat] = live ? next : 0.0;
#endif
        }
        barrier();
    }
    if (unit) {
#if HAS_YH
        pc.yh.v[state_at] = h[j];
#endif
#if HAS_YC
        pc.yc.v[state_at] = c;
#endif
    }
}
#endif
