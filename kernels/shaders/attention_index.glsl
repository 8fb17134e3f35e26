// Attention's layouts and mask, shared by attention.comp and attention_tiled.comp; included after
// the push constants (``bias`` reads pc.mask and pc.nonpad). Defines as attention.comp describes.
#define NEG_INF uintBitsToFloat(0xff800000u)

uint q_index(uint b, uint h, uint i, uint d) {
#if Q3D
    return ((b * S + i) * HQ + h) * D + d;
#else
    return ((b * HQ + h) * S + i) * D + d;
#endif
}

uint y_index(uint b, uint h, uint i, uint d) {
#if Q3D
    return ((b * S + i) * HQ + h) * DV + d;
#else
    return ((b * HQ + h) * S + i) * DV + d;
#endif
}

uint kv_index(uint b, uint h, uint j, uint d, uint dim) {
#if KV3D
    return ((b * T + j) * HKV + h) * dim + d;
#else
    return ((b * HKV + h) * T + j) * dim + d;
#endif
}

float bias(uint b, uint h, uint i, uint j) {
    float r = 0.0;
#if HAS_MASK
    if (j >= MASK_LEN) return NEG_INF;
    uint m = b * MSB + h * MSH + i * MSS + j;
#if MASK_BOOL
    if (uint(U8Buf(pc.mask).v[m]) == 0u) return NEG_INF;
#else
    r = pc.mask.v[m];
#endif
#endif
#if NONPAD
    int64_t valid = pc.nonpad.v[b];
    int64_t offset = valid - int64_t(S);
    if (int64_t(j) >= valid) return NEG_INF;
#else
    int64_t offset = int64_t(PAST);
#endif
    int64_t diff = int64_t(i) + offset - int64_t(j);
#if CAUSAL
    if (diff < 0) return NEG_INF;
#endif
#if WL >= 0
    if (diff > int64_t(WL)) return NEG_INF;
#endif
#if WR >= 0
    if (-diff > int64_t(WR)) return NEG_INF;
#endif
    return r;
}
