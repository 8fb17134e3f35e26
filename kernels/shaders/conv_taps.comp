#version 450
// Implicit-GEMM convolution on a CPU-like device (lavapipe): gemm.comp's register tiling with
// CONV (one subgroup of WG invocations, TM output channels x TN columns each in registers, the
// weight's loads shared by subgroupShuffle), with the window arithmetic per element moved out of
// the k loop. Each column's input offset and a mask of the window taps (kd, kh, kw) that fall
// inside the padded input are computed once; each step of k then adds its tap's offset and
// tests one bit, where gemm.comp recomputes three coordinates and six bounds. At most 64 taps
// per window (KD*KH*KW; masks of 64 bits past 32). Push constants and defines as gemm.comp's register tiling with CONV.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "common.glsl"
#include "epilogue.glsl"

layout(local_size_x = WG) in;

layout(push_constant) uniform Args {
    F32Buf a;
    F32Buf b;
    F32Buf c;
    F32Buf y;
    uint M, N, K;
    uint sAm, sAk, sBk, sBn, sCm, sCn;
    uint bA, bB, bC;  // batch strides of A, B, C (elements); Y's is M * N
    float alpha, beta;
#if HAS_RES
    F32Buf r;  // the residual, as gemm.comp's
#endif
} pc;

#define TAPS (KD * KH * KW)
#if TAPS > 32
#define MASK uint64_t
#else
#define MASK uint
#endif

void main() {
    const uint tx = gl_LocalInvocationIndex;
    const uint row0 = gl_WorkGroupID.y * TM;
    const uint col0 = gl_WorkGroupID.x * (TN * WG);
#if SPLITS > 1
    const uint z = gl_WorkGroupID.z / SPLITS;
    const uint split = gl_WorkGroupID.z % SPLITS;
    const uint kBegin = split * KCHUNK;
    const uint kEnd = min(pc.K, kBegin + KCHUNK);
#else
    const uint z = gl_WorkGroupID.z;
    const uint kBegin = 0;
    const uint kEnd = pc.K;
#endif
    const uint g = z % G;
    const uint aBase = g * pc.bA;
    const uint bBase = (z / G) * (G * CG * ID * IH * IW) + g * pc.bB;
    const uint cBase = g * pc.bC;
    const uint M = pc.M, N = pc.N;

    float acc[TM][TN];
    for (uint i = 0; i < TM; ++i)
        for (uint j = 0; j < TN; ++j) acc[i][j] = 0.0;
    // rows past the edge read row 0 (always there) and are not written
    uint aRow[TM];
    for (uint i = 0; i < TM; ++i) aRow[i] = aBase + (row0 + i < M ? row0 + i : 0u) * pc.sAm;
    // per column: the input offset of its window's origin and which taps are inside the input
    // (none for a column past the edge)
    int origin[TN];
    MASK inside[TN];
    for (uint j = 0; j < TN; ++j) {
        const uint n = col0 + tx + j * WG;
        const uint ow = n % OW, u = n / OW;
        const uint oh = u % OH, od = u / OH;
        const int d0 = int(od * SD) - PD, h0 = int(oh * SH) - PH, w0 = int(ow * SW) - PW;
        origin[j] = (d0 * int(IH) + h0) * int(IW) + w0;
        MASK bits = MASK(0);
        for (uint t = 0; t < TAPS; ++t) {
            const int id = d0 + int((t / (KH * KW)) * DD);
            const int ih = h0 + int(((t / KW) % KH) * DH);
            const int iw = w0 + int((t % KW) * DW);
            if (n < N && uint(id) < ID && uint(ih) < IH && uint(iw) < IW) bits |= MASK(1) << t;
        }
        inside[j] = bits;
    }
    // k = ch * TAPS + t; the tap's offset from the window's origin advances by carries
    uint t = kBegin % TAPS;
    uint kw = t % KW, kh = (t / KW) % KH, kd = t / (KW * KH);
    uint chBase = bBase + (kBegin / TAPS) * (ID * IH * IW);

    for (uint k0 = kBegin; k0 < kEnd; k0 += WG) {
        float ar[TM];
        for (uint i = 0; i < TM; ++i) ar[i] = k0 + tx < kEnd ? pc.a.v[aRow[i] + (k0 + tx) * pc.sAk] : 0.0;
        const uint steps = min(WG, kEnd - k0);
        for (uint s = 0; s < steps; ++s) {
            const int tapBase = int(chBase) + int(((kd * DD) * IH + kh * DH) * IW + kw * DW);
            const MASK bit = MASK(1) << t;
            float bv[TN];
            for (uint j = 0; j < TN; ++j) {
                const bool in_ = (inside[j] & bit) != MASK(0);
                const float v = pc.b.v[in_ ? uint(tapBase + origin[j]) : 0u];
                bv[j] = in_ ? v : 0.0;
            }
            for (uint i = 0; i < TM; ++i) {
                const float av = subgroupShuffle(ar[i], s);
                for (uint j = 0; j < TN; ++j) acc[i][j] = fma(av, bv[j], acc[i][j]);
            }
            ++t;
            if (++kw == KW) {
                kw = 0;
                if (++kh == KH) {
                    kh = 0;
                    if (++kd == KD) { kd = 0; t = 0; chBase += ID * IH * IW; }
                }
            }
        }
    }

#if SPLITS > 1
    // raw partial sums; gemm_reduce.comp applies alpha and the bias
    const uint yBase = (split * gl_NumWorkGroups.z / SPLITS + z) * M * N;
#else
    const uint yBase = z * M * N;
#endif
    for (uint i = 0; i < TM; ++i) {
        const uint m = row0 + i;
        if (m >= M) continue;
        for (uint j = 0; j < TN; ++j) {
            const uint n = col0 + tx + j * WG;
            if (n >= N) continue;
#if SPLITS > 1
            pc.y.v[yBase + m * N + n] = acc[i][j];
#else
            float v = pc.alpha * acc[i][j];
#if HAS_BIAS
            v += pc.beta * pc.c.v[cBase + m * pc.sCm + n * pc.sCn];
#endif
#if HAS_RES
            v += pc.r.v[yBase + m * N + n];
#endif
            pc.y.v[yBase + m * N + n] = epilogue(v);
#endif
        }
    }
}
