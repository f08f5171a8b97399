/* The CB_FMT_I16 layouts (panels.h, i16.h): repacking a panel of a 4-6-bit block format into its int16-pairs
 * layout (cb_repack_i16), and decoding chunks of such a panel to float32 for the tiled path (gemm.c via
 * cb_panel_chunk) and cb_unpack_panels: the same float32 weights as the format's own decoder, bit for bit. */
#include "i16.h"

/* Column c's 32 values of a block in the plain layout: the nibbles, with Q5's fifth bit and Q6_K's two high bits. */
static void plain_values(const int fmt, const i16_block_t *B, int c, uint8_t v[CB_QK]) {
    for (int j = 0; j < I16_PAIRS; ++j) {
        const uint8_t byte = B->q[j * CB_NR + c];
        v[2 * j] = byte & 15;
        v[2 * j + 1] = byte >> 4;
    }
    for (int t = 0; t < CB_QK; ++t) {
        if (fmt == CB_FMT_Q5_0 || fmt == CB_FMT_Q5_K)
            v[t] |= (uint8_t)(((B->qh[t / 8 * CB_NR + c] >> (t % 8)) & 1) << 4);
        else if (fmt == CB_FMT_Q6_K)
            v[t] |= (uint8_t)(((B->qh[t / 4 * CB_NR + c] >> (2 * (t % 4))) & 3) << 4);
    }
}

/* Column c's 32 values v written in the int16-pairs layout (i16.h); B: a block of the panel being repacked */
static void put_pairs(const int fmt, const i16_block_t *B, int c, const uint8_t v[CB_QK]) {
    uint8_t *q = (uint8_t *)B->q, *qh = (uint8_t *)B->qh; /* the output panel's: writable */
    for (int g = 0; g < 4; ++g) {
        uint32_t w = 0;
        for (int p = 0; p < 4; ++p)
            w |= (uint32_t)(v[8 * g + 2 * p] & 15) << 4 * p | (uint32_t)(v[8 * g + 2 * p + 1] & 15) << (16 + 4 * p);
        memcpy(q + (g * CB_NR + c) * 4, &w, 4);
    }
    if (fmt == CB_FMT_Q5_0 || fmt == CB_FMT_Q5_K) {
        uint32_t h = 0;
        for (int m = 0; m < I16_PAIRS; ++m)
            h |= (uint32_t)((v[2 * m] >> 4) & 1) << m | (uint32_t)((v[2 * m + 1] >> 4) & 1) << (16 + m);
        memcpy(qh + c * 4, &h, 4);
    } else if (fmt == CB_FMT_Q6_K) {
        for (int half = 0; half < 2; ++half) {
            uint32_t h = 0;
            for (int m = 0; m < I16_PAIRS / 2; ++m) {
                const int t = 16 * half + 2 * m;
                h |= (uint32_t)((v[t] >> 4) & 3) << 2 * m | (uint32_t)((v[t + 1] >> 4) & 3) << (16 + 2 * m);
            }
            memcpy(qh + (half * CB_NR + c) * 4, &h, 4);
        }
    }
}

/* packed (fmt, [n, k]) -> out in fmt | CB_FMT_I16's layout (out may be packed: in place). */
int cb_repack_i16(int fmt, const uint8_t *packed, int n, int k, uint8_t *out) {
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    if (!cb_i16_format(fmt) || n < 1 || pbytes < 0) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, nb = k / CB_QK;
    if (out != packed) memcpy(out, packed, (size_t)(panels * pbytes)); /* the scales, and the bytes to regroup */
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p)
        for (int b = 0; b < nb; ++b) {
            const i16_block_t B = i16_block(fmt, out + p * pbytes, b);
            uint8_t v[CB_NR][CB_QK];
            for (int c = 0; c < CB_NR; ++c) plain_values(fmt, &B, c, v[c]);
            for (int c = 0; c < CB_NR; ++c) put_pairs(fmt, &B, c, v[c]);
        }
    return CB_OK;
}

/* k values [k0, k0 + kn) of one panel: each pair's two int16 halves decoded as scale * q + offset */
static inline __attribute__((always_inline)) void chunk_fmt(const int fmt, const uint8_t *restrict panel, int k0,
                                                            int kn, float *restrict dst) {
    for (int b = k0 / CB_QK, o = 0; o < kn; ++b, o += CB_QK) {
        const i16_block_t B = i16_block(fmt, panel, b);
        for (int v = 0; v < CB_PV; ++v) {
            const int c = CB_VW * v;
            vf scale[2], offset[2];
            i16_scales(fmt, &B, c, 0, scale, offset);
            if (fmt == CB_FMT_Q6_K)
                i16_scales(fmt, &B, c, 1, scale + 1, offset + 1);
            else
                scale[1] = scale[0], offset[1] = offset[0];
#pragma GCC unroll 16 /* i a constant: the shifts */
            for (int i = 0; i < I16_PAIRS; ++i) {
                const vi w = i16_pair(fmt, &B, c, i);
                const int h = i >= I16_PAIRS / 2;
                float *out = dst + (int64_t)(o + 2 * i) * CB_NR + c;
                cb_store(out, scale[h] * to_float(w & 0xFFFF) + offset[h]);
                cb_store(out + CB_NR, scale[h] * to_float(i16_shift(w, -16)) + offset[h]);
            }
        }
    }
}

const float *cb_i16_chunk(int fmt, const uint8_t *panel, int k0, int kn, float *scratch) {
    switch (fmt) {
    case CB_FMT_Q4_0: chunk_fmt(CB_FMT_Q4_0, panel, k0, kn, scratch); break;
    case CB_FMT_Q4_1: chunk_fmt(CB_FMT_Q4_1, panel, k0, kn, scratch); break;
    case CB_FMT_Q5_0: chunk_fmt(CB_FMT_Q5_0, panel, k0, kn, scratch); break;
    case CB_FMT_Q4_K: chunk_fmt(CB_FMT_Q4_K, panel, k0, kn, scratch); break;
    case CB_FMT_Q5_K: chunk_fmt(CB_FMT_Q5_K, panel, k0, kn, scratch); break;
    default: chunk_fmt(CB_FMT_Q6_K, panel, k0, kn, scratch); break;
    }
    return scratch;
}
