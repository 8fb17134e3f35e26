#version 450
// y = cond ? x : z with multidirectional broadcasting of all three, rank <= 5 (after merging
// dimensions: four pointers and four stride sets fill the 128-byte push-constant block).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    U8Buf c;
    WBUF x;
    WBUF z;
    WBUF y;
    uint n;
    uint rank;
    uint shape[5];
    uint cstride[5];
    uint xstride[5];
    uint zstride[5];
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint ic = 0, ix = 0, iz = 0, rem = i;
    for (int d = int(pc.rank) - 1; d >= 0; --d) {
        uint k = rem % pc.shape[d];
        rem /= pc.shape[d];
        ic += k * pc.cstride[d];
        ix += k * pc.xstride[d];
        iz += k * pc.zstride[d];
    }
    pc.y.v[i] = uint(pc.c.v[ic]) != 0u ? pc.x.v[ix] : pc.z.v[iz];
}
