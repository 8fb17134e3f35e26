#version 450
// One pairwise step of Einsum: y[o] = sum_s a[o, s] * b[o, s] (B absent when ONE_OPERAND),
// where every output letter and summed letter has an extent and a stride in each operand
// (0 where the operand lacks the letter; the sum of strides for a repeated letter, which is a
// diagonal). Letters, extents and strides are defines: one pipeline per node.
// NO/NS: numbers of output/summed letters; OEXT/OSA/OSB and SEXT/SSA/SSB: comma lists with a
// trailing pad entry (arrays must not be empty). The sum runs over s = start .. start+count-1;
// a piece after the first adds to what the previous piece wrote (the same order as one pass).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;

layout(push_constant) uniform Args {
    TBUF a;
    TBUF b;
    TBUF y;
    uint start;
    uint count;
} pc;

const uint OEXT_[NO + 1] = uint[NO + 1](OEXT);
const uint OSA_[NO + 1] = uint[NO + 1](OSA);
const uint OSB_[NO + 1] = uint[NO + 1](OSB);
const uint SEXT_[NS + 1] = uint[NS + 1](SEXT);
const uint SSA_[NS + 1] = uint[NS + 1](SSA);
const uint SSB_[NS + 1] = uint[NS + 1](SSB);

void main() {
    uint e = flat_index();
    if (e >= NOUT) return;
    uint rem = e, ia = 0, ib = 0;
    for (int d = NO - 1; d >= 0; --d) {
        uint c = rem % OEXT_[d];
        rem /= OEXT_[d];
        ia += c * OSA_[d];
        ib += c * OSB_[d];
    }
    T acc = pc.start > 0 ? pc.y.v[e] : T(0);
    for (uint s = pc.start; s < min(NSUM, pc.start + pc.count); ++s) {
        uint r = s, ja = ia, jb = ib;
        for (int d = NS - 1; d >= 0; --d) {
            uint c = r % SEXT_[d];
            r /= SEXT_[d];
            ja += c * SSA_[d];
            jb += c * SSB_[d];
        }
#if ONE_OPERAND
        acc += pc.a.v[ja];
#else
        acc += pc.a.v[ja] * pc.b.v[jb];
#endif
    }
    pc.y.v[e] = acc;
}
