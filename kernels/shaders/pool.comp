#version 450
// MaxPool / AveragePool, one output element per invocation. Geometry is compiled in
// (defines, spatial dims padded to 3): I*/O* input/output extents, K* kernel, S* strides,
// D* dilations, P* leading and Q* trailing pads. MODE 0 = max (T/TBUF element type, optional
// int64 Indices into the flattened input, row-major or column-major per STORAGE_ORDER),
// MODE 1 = average (float), dividing by the window positions inside the input, or with
// COUNT_INCLUDE_PAD inside the padded input (never beyond it: ceil_mode windows),
// MODE 2 = LpPool (float): the P-norm of the window positions inside the input.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = LOCAL_SIZE) in;

#ifndef T
#define T float
#define TBUF F32Buf
#endif
#if BYTE_T
// NOTE: 8-bit storage alone converts uint8_t only to and from 32-bit integers (glslang 13).
#define TO_FLOAT(v) float(uint(v))
#define FROM_FLOAT(v) T(uint(v))
#else
#define TO_FLOAT(v) float(v)
#define FROM_FLOAT(v) T(v)
#endif

layout(push_constant) uniform Args {
    TBUF x;
    TBUF y;
    I64Buf idx;
    uint n;
} pc;

void main() {
    uint i = flat_index();
    if (i >= pc.n) return;
    uint ow = i % OW; uint t = i / OW;
    uint oh = t % OH; t /= OH;
    uint od = t % OD; uint nc = t / OD;
    uint base = nc * (ID * IH * IW);
    int d0 = int(od * SD) - PD, h0 = int(oh * SH) - PH, w0 = int(ow * SW) - PW;
#if MODE == 0
    float best = 0.0;
    bool found = false;
    uint where = 0;
#else
    float sum = 0.0;
    uint count = 0;
#endif
    for (int kd = 0; kd < KD; ++kd) {
        int id = d0 + kd * DD;
        for (int kh = 0; kh < KH; ++kh) {
            int ih = h0 + kh * DH;
            for (int kw = 0; kw < KW; ++kw) {
                int iw = w0 + kw * DW;
                bool inside = id >= 0 && id < ID && ih >= 0 && ih < IH && iw >= 0 && iw < IW;
#if MODE == 0
                if (!inside) continue;
                uint off = (uint(id) * IH + uint(ih)) * IW + uint(iw);
                float v = TO_FLOAT(pc.x.v[base + off]);
                if (!found || v > best) {
                    best = v;
                    found = true;
#if STORAGE_ORDER == 1
                    where = uint(id) + uint(ih) * ID + uint(iw) * (ID * IH);
#else
                    where = off;
#endif
                }
#elif MODE == 2
                if (inside) {
                    float v = abs(pc.x.v[base + (uint(id) * IH + uint(ih)) * IW + uint(iw)]);
                    sum += P == 2 ? v * v : pow(v, float(P));
                }
#else
                if (inside) sum += pc.x.v[base + (uint(id) * IH + uint(ih)) * IW + uint(iw)];
#if COUNT_INCLUDE_PAD
                if (id >= -PD && id < ID + QD && ih >= -PH && ih < IH + QH && iw >= -PW && iw < IW + QW) ++count;
#else
                if (inside) ++count;
#endif
#endif
            }
        }
    }
#if MODE == 0
    pc.y.v[i] = FROM_FLOAT(best);
#if INDICES
    pc.idx.v[i] = found ? int64_t(base + where) : int64_t(-1);
#endif
#elif MODE == 2
    pc.y.v[i] = P == 2 ? sqrt(sum) : (P == 1 ? sum : pow(sum, 1.0 / float(P)));
#else
    pc.y.v[i] = sum / float(count);
#endif
}
