#version 450
// ConvInteger (MODE 0: int32 y = sum (x - x_zero) (w - w_zero)) and QLinearConv (MODE 1: y =
// clamp(roundEven((that + B) * x_scale * w_scale / y_scale) + y_zero, QMIN, QMAX)), one output
// element per invocation; the geometry is conv.comp's (defines). x_zero is per tensor; w_zero and
// w_scale per tensor or per output channel (W_ZERO_PER_M, W_SCALE_PER_M). Padding reads as
// x_zero, so padded positions add nothing. X*/W*/Y* are the element types.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "elem_types.glsl"
layout(local_size_x = LOCAL_SIZE) in;

layout(push_constant) uniform Args {
    XBUF x;
    WBUF w;
    XBUF x_zero;   // x when absent
    WBUF w_zero;   // w when absent
    F32Buf x_scale;  // MODE 1 only (x otherwise)
    F32Buf w_scale;
    F32Buf y_scale;
    YBUF y_zero;
    I32Buf bias;   // y when absent
    YBUF y;
    uint n;
    uint has_x_zero;
    uint has_w_zero;
} pc;

#define CG (C / G)
#define MG (M / G)

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint ow = i % OW; uint t = i / OW;
    uint oh = t % OH; t /= OH;
    uint od = t % OD; t /= OD;
    uint m = t % M; uint img = t / M;
    uint g = m / MG;
    int zx = pc.has_x_zero != 0u ? int(XCT(pc.x_zero.v[0])) : 0;
    int zw = pc.has_w_zero != 0u ? int(WCT(pc.w_zero.v[W_ZERO_PER_M != 0 ? m : 0u])) : 0;
    int acc = 0;
    uint xc = (img * C + g * CG) * (ID * IH * IW);
    uint wc = m * (CG * KD * KH * KW);
    for (uint c = 0; c < CG; ++c) {
        for (uint kd = 0; kd < KD; ++kd) {
            int id = int(od * SD + kd * DD) - PD;
            if (id < 0 || id >= ID) continue;
            for (uint kh = 0; kh < KH; ++kh) {
                int ih = int(oh * SH + kh * DH) - PH;
                if (ih < 0 || ih >= IH) continue;
                uint xrow = xc + (uint(id) * IH + uint(ih)) * IW;
                uint wrow = wc + ((c * KD + kd) * KH + kh) * KW;
                for (uint kw = 0; kw < KW; ++kw) {
                    int iw = int(ow * SW + kw * DW) - PW;
                    if (iw < 0 || iw >= IW) continue;
                    acc += (int(XCT(pc.x.v[xrow + uint(iw)])) - zx) * (int(WCT(pc.w.v[wrow + kw])) - zw);
                }
            }
        }
        xc += ID * IH * IW;
    }
#if MODE == 0
    pc.y.v[i] = YT(acc);
#else
#if HAS_BIAS
    acc += pc.bias.v[m];
#endif
    float scale = div_rn(pc.x_scale.v[0] * pc.w_scale.v[W_SCALE_PER_M != 0 ? m : 0u], pc.y_scale.v[0]);
    float zero = float(YCT(pc.y_zero.v[0]));
    pc.y.v[i] = YT(YCT(clamp(roundEven(float(acc) * scale) + zero, QMIN, QMAX)));
#endif
}
