#version 450
// DynamicQuantizeLinear to uint8. MODE 0 (one workgroup): scale = (max(0, max x) - min(0, min x))
// / 255 and zero point = clamp(roundEven(-min / scale), 0, 255) into their outputs. MODE 1:
// y = clamp(roundEven(x / scale) + zero point, 0, 255), reading both back.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    F32Buf x;
    U8Buf y;
    F32Buf scale;
    U8Buf zero;
    uint n;
} pc;

#if MODE == 0
shared vec2 part[LOCAL_SIZE];  // (min, max)

void main() {
    const uint lane = gl_LocalInvocationID.x;
    vec2 acc = vec2(0.0);  // the range always includes 0
    for (uint i = lane; i < pc.n; i += LOCAL_SIZE) {
        float v = pc.x.v[i];
        acc = vec2(min(acc.x, v), max(acc.y, v));
    }
    part[lane] = acc;
    barrier();
    for (uint s = LOCAL_SIZE / 2; s > 0; s >>= 1) {
        if (lane < s) {
            part[lane] = vec2(min(part[lane].x, part[lane + s].x), max(part[lane].y, part[lane + s].y));
        }
        barrier();
    }
    if (lane == 0u) {
        float scale = div_rn(part[0].y - part[0].x, 255.0);
        pc.scale.v[0] = scale;
        pc.zero.v[0] = uint8_t(uint(scale > 0.0 ? clamp(roundEven(div_rn(-part[0].x, scale)), 0.0, 255.0) : 0.0));
    }
}
#else
void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    float scale = pc.scale.v[0];
    float q = scale > 0.0 ? roundEven(div_rn(pc.x.v[i], scale)) + float(uint(pc.zero.v[0])) : 0.0;
    pc.y.v[i] = uint8_t(uint(clamp(q, 0.0, 255.0)));
}
#endif
