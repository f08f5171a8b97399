/* The CB_FMT_I16 layouts (panels.h, i16.h): repacking a panel of a 4-8-bit block format into its int16-pairs
 * layout (cb_repack_i16), and decoding chunks of such a panel to float32 for the tiled path (gemm.c via
 * cb_panel_chunk) and cb_unpack_panels: the same float32 weights as the format's own decoder, bit for bit. */
#include "i16.h"

/* The repacking regroups one block's bits at a time from a copy of them (the layouts overlap in place), each loop
 * over the 48 columns innermost so that the compiler vectorizes it. */

/* q [16][48] bytes (k = 2j low nibble, 2j + 1 high) -> uint32 [4][48]: dword g holds k = 8g + 2p at bits 4p and
 * k = 8g + 2p + 1 at bits 16 + 4p */
static void regroup_nibbles(uint8_t *q) {
    uint8_t in[CB_QK / 2 * CB_NR];
    uint32_t out[4 * CB_NR];
    memcpy(in, q, sizeof in);
    for (int g = 0; g < 4; ++g)
        for (int c = 0; c < CB_NR; ++c) {
            uint32_t w = 0;
            for (int p = 0; p < 4; ++p) {
                const uint32_t byte = in[(4 * g + p) * CB_NR + c];
                w |= (byte & 15) << 4 * p | (byte >> 4) << (16 + 4 * p);
            }
            out[g * CB_NR + c] = w;
        }
    memcpy(q, out, sizeof out);
}

/* The even bits (0, 2, 4, 6) of byte x as 4 bits */
static inline uint32_t even_bits(uint32_t x) {
    x &= 0x55;
    x = (x | x >> 1) & 0x33;
    return (x | x >> 2) & 0x0F;
}

/* Q5's qh [4][48] bytes (the fifth bit of k = 8i + t at bit t of byte [i]) -> uint32 [48]: k = 2m at bit m, k = 2m
 * + 1 at bit 16 + m */
static void regroup_fifth_bits(uint8_t *qh) {
    uint8_t in[CB_QK / 8 * CB_NR];
    uint32_t out[CB_NR];
    memcpy(in, qh, sizeof in);
    for (int c = 0; c < CB_NR; ++c) {
        uint32_t h = 0;
        for (int i = 0; i < 4; ++i) {
            const uint32_t byte = in[i * CB_NR + c];
            h |= even_bits(byte) << 4 * i | even_bits(byte >> 1) << (16 + 4 * i);
        }
        out[c] = h;
    }
    memcpy(qh, out, sizeof out);
}

/* Q6_K's qh [8][48] bytes (the two high bits of k = 4i + t at bits 2t of byte [i]) -> uint32 [2][48]: half h, k =
 * 16h + 2m at bits 2m, k = 16h + 2m + 1 at bits 16 + 2m */
static void regroup_high_bits(uint8_t *qh) {
    uint8_t in[CB_QK / 4 * CB_NR];
    uint32_t out[2 * CB_NR];
    memcpy(in, qh, sizeof in);
    for (int h = 0; h < 2; ++h)
        for (int c = 0; c < CB_NR; ++c) {
            uint32_t w = 0;
            for (int i = 0; i < 4; ++i) { /* byte 4h + i: k = 16h + 4i + t, t = 0, 2 even, 1, 3 odd */
                const uint32_t byte = in[(4 * h + i) * CB_NR + c];
                w |= ((byte & 3) | (byte >> 2 & 0x0C)) << 4 * i | ((byte >> 2 & 3) | (byte >> 4 & 0x0C)) << (16 + 4 * i);
            }
            out[h * CB_NR + c] = w;
        }
    memcpy(qh, out, sizeof out);
}

/* Q8_0's q [32][48] bytes -> [16][48][2]: k = 2i and 2i + 1 of a column side by side */
static void regroup_byte_pairs(uint8_t *q) {
    uint8_t in[CB_QK * CB_NR];
    memcpy(in, q, sizeof in);
    for (int i = 0; i < CB_QK / 2; ++i)
        for (int c = 0; c < CB_NR; ++c) {
            q[(i * CB_NR + c) * 2] = in[2 * i * CB_NR + c];
            q[(i * CB_NR + c) * 2 + 1] = in[(2 * i + 1) * CB_NR + c];
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
            const i16_block_t B = i16_block(fmt, out + p * pbytes, b); /* out's: writable */
            if (fmt == CB_FMT_Q8_0) {
                regroup_byte_pairs((uint8_t *)B.q);
                continue;
            }
            regroup_nibbles((uint8_t *)B.q);
            if (fmt == CB_FMT_Q5_0 || fmt == CB_FMT_Q5_K) regroup_fifth_bits((uint8_t *)B.qh);
            if (fmt == CB_FMT_Q6_K) regroup_high_bits((uint8_t *)B.qh);
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
                cb_store(out, scale[h] * to_float(i16_low(fmt, w)) + offset[h]);
                cb_store(out + CB_NR, scale[h] * to_float(w >> 16) + offset[h]);
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
    case CB_FMT_Q8_0: chunk_fmt(CB_FMT_Q8_0, panel, k0, kn, scratch); break;
    default: chunk_fmt(CB_FMT_Q6_K, panel, k0, kn, scratch); break;
    }
    return scratch;
}
