#version 450
// Writes n bytes repeating a pattern of `period` bytes (at most 104) carried in the push
// constants: constant outputs (Shape, Size, ConstantOfShape, Dropout's mask) of any type.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    U8Buf y;
    uint n;
    uint period;
    uint words[26];
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint k = i % pc.period;
    pc.y.v[i] = uint8_t((pc.words[k >> 2] >> (8u * (k & 3u))) & 0xffu);
}
