// Attention's layouts and mask, shared by attention.comp and attention_tiled.comp; included after
// the push constants (``bias`` reads pc.mask and pc.nonpad). Defines as attention.comp describes.
#define NEG_INF uintBitsToFloat(0xff800000u)

// Q and Y share a layout: [B, S, HQ*dim] (Q3D) or [B, HQ, S, dim]
uint query_index(uint b, uint h, uint i, uint d, uint dim) {
#if Q3D
    return ((b * S + i) * HQ + h) * dim + d;
#else
    return ((b * HQ + h) * S + i) * dim + d;
#endif
}

#ifdef QKV_ROW
// packed_qkv (3-D, no cache): Q, K and V are column ranges of rows of QKV_ROW elements, their
// pointers at the first column of each
uint q_index(uint b, uint h, uint i, uint d) { return (b * S + i) * QKV_ROW + h * D + d; }
uint kv_index(uint b, uint h, uint j, uint d, uint dim) { return (b * T + j) * QKV_ROW + h * dim + d; }
#else
uint q_index(uint b, uint h, uint i, uint d) { return query_index(b, h, i, d, D); }

uint kv_index(uint b, uint h, uint j, uint d, uint dim) {
#if KV3D
    return ((b * T + j) * HKV + h) * dim + d;
#else
    return ((b * HKV + h) * T + j) * dim + d;
#endif
}
#endif
uint y_index(uint b, uint h, uint i, uint d) { return query_index(b, h, i, d, DV); }

float bias(uint b, uint h, uint i, uint j) {
    float r = 0.0;
#if HAS_MASK
    if (j >= MASK_LEN) return NEG_INF;
    uint m = b * MSB + h * MSH + i * MSS + j;
#if MASK_BOOL
    if (uint(U8Buf(pc.mask).v[m]) == 0u) return NEG_INF;
#else
    r = float(pc.mask.v[m]);
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
