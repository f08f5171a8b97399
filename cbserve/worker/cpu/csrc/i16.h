/* The CB_FMT_I16 layouts (panels.h) read as int16 pairs: where a block's bytes are, its scales, and the weights of
 * k pair i (k = 2i and 2i + 1 of the block) of CB_VW columns as one 32-bit lane each, k = 2i in the low int16 and
 * 2i + 1 in the high one, what a pairwise multiply-add (vpdpwssd, vpmaddwd) takes. Shared by the few-row products
 * (rows_i16.c), the tiled path's chunk decoder and the repacking (panels_i16.c). Internal to the kernels.
 *
 * Each column's 16 nibble bytes are 4 dwords, dword g holding k = 8g .. 8g + 7 with the nibble of k = 8g + 2p at
 * bits 4p and of k = 8g + 2p + 1 at bits 16 + 4p: pair i = 4g + p is (dword >> 4p) & 0x000F000F, one shift and one
 * and from a full-width load of consecutive columns' dwords. The high bits follow the same idea: Q5's 32 fifth
 * bits are one dword per column, bit m for k = 2m and bit 16 + m for k = 2m + 1, so pair i's are at bits 4 and 20
 * after one shift by 4 - i; Q6_K's 64 high bits are two dwords (k 0-15, 16-31), bits 2m for k = 2m (m = i % 8) and
 * 16 + 2m for k = 2m + 1, at bits 4-5 and 20-21 after one shift by 4 - 2m. Q8_0's bytes are pairs: [16][48][2], a
 * column's k = 2i and 2i + 1 side by side, so that a load and a sign extension give a lane's two int16s. */
#ifndef CB_I16_H
#define CB_I16_H

#include "decode.h"

#define I16_PAIRS (CB_QK / 2) /* pairs per block */
#define I16_NIBBLES 0x000F000F
#define I16_FIFTH 0x00100010
#define I16_SIXTH 0x00300030

typedef uint32_t vu __attribute__((vector_size(CB_VW * 4), aligned(4)));

/* One block of a panel: its bytes (start, bytes, as prefetch_ahead wants them; a K-quant block's first also covers
 * its super-block's header), its float16 scales d (the block's for Q4_0, Q4_1, Q5_0, m after d for Q4_1; the
 * super-block's d and dmin for the K-quants), the K-quants' sub-scales (Q4_K, Q5_K: sc[48], m[48]; Q6_K: sc[2][48]),
 * the nibble dwords q [4][48] and the high bits' dwords qh (Q5_0, Q5_K: [48]; Q6_K: [2][48]). fmt: a base format. */
typedef struct {
    const uint8_t *start, *sub, *q, *qh;
    const uint16_t *d;
    int bytes;
} i16_block_t;

static inline __attribute__((always_inline)) i16_block_t i16_block(const int fmt, const uint8_t *panel, int b) {
    i16_block_t B;
    if (fmt == CB_FMT_Q8_0) { /* d[48], then q as [16 pairs][48][2] int8 (cb_repack_i16) */
        B.bytes = Q8_BLOCK_BYTES;
        B.start = B.sub = B.qh = panel + (int64_t)b * B.bytes;
        B.q = B.start + Q8_Q;
        B.d = (const uint16_t *)B.start;
        return B;
    }
    if (fmt == CB_FMT_Q4_0 || fmt == CB_FMT_Q4_1 || fmt == CB_FMT_Q5_0) {
        B.bytes = fmt == CB_FMT_Q4_1 ? Q41_BLOCK_BYTES : fmt == CB_FMT_Q4_0 ? Q40_BLOCK_BYTES : Q50_BLOCK;
        B.start = B.sub = panel + (int64_t)b * B.bytes;
        B.q = B.start + (fmt == CB_FMT_Q4_1 ? Q41_Q : Q40_Q);
        B.qh = B.start + Q50_QH;
        B.d = (const uint16_t *)B.start;
        return B;
    }
    const int q6 = fmt == CB_FMT_Q6_K, five = fmt == CB_FMT_Q5_K;
    const int64_t super = q6 ? Q6K_SUPER : five ? Q5K_SUPER : Q4K_SUPER;
    const int head = q6 ? Q6K_HEAD : Q4K_HEAD, bytes = q6 ? Q6K_BLOCK : five ? Q5K_BLOCK : Q4K_BLOCK;
    B.d = (const uint16_t *)kq_head(panel, super, b);
    B.sub = kq_block(panel, super, head, bytes, b);
    B.q = B.sub + (q6 ? Q6K_QL : Q4K_Q);
    B.qh = B.sub + (q6 ? Q6K_QH : Q5K_QH);
    B.start = B.sub - (b % CB_KSUB ? 0 : head);
    B.bytes = bytes + (b % CB_KSUB ? 0 : head);
    return B;
}

/* The block's values of columns [c, c + CB_VW) are scale * q + offset (Q6_K: half 0 for k 0-15, 1 for 16-31), with
 * the expressions the other formats' decoders use (decode.h), so they decode to the same float32 weights. */
static inline __attribute__((always_inline)) void i16_scales(const int fmt, const i16_block_t *B, int c, int half,
                                                             vf *scale, vf *offset) {
    const vf d = half_value(B->d + c);
    if (fmt == CB_FMT_Q4_K || fmt == CB_FMT_Q5_K) {
        *scale = q4_k_scale(d, B->sub + c);
        *offset = q4_k_offset(half_value(B->d + CB_NR + c), B->sub + CB_NR + c);
    } else if (fmt == CB_FMT_Q6_K) {
        *scale = q6_k_scale(d, (const int8_t *)B->sub + half * CB_NR + c);
        *offset = q6_k_offset(*scale);
    } else {
        *scale = d;
        *offset = fmt == CB_FMT_Q8_0   ? (vf){0}
                  : fmt == CB_FMT_Q4_1 ? half_value(B->d + CB_NR + c)
                  : fmt == CB_FMT_Q5_0 ? d * -16.0f
                                       : q4_0_offset(d);
    }
}

/* x shifted left by n (right by -n, logical); n a constant once the loops are unrolled */
static inline vi i16_shift(vi x, const int n) { return n >= 0 ? x << n : (vi)((vu)x >> -n); }

/* The low int16 of each lane of a pair vector, as int32: Q8_0's signed, the other formats' (0..63) as they are. The
 * high one is w >> 16 for all (arithmetic: the same for the others' non-negative values). */
static inline vi i16_low(const int fmt, vi w) { return fmt == CB_FMT_Q8_0 ? (w << 16) >> 16 : w & 0xFFFF; }

typedef int8_t vpair8 __attribute__((vector_size(CB_VW * 2), aligned(1)));
typedef int16_t vpair16 __attribute__((vector_size(CB_VW * 4)));

/* The weights of pair i (0..15, a constant once unrolled) of columns [c, c + CB_VW), as int16 pairs (Q8_0: its
 * two signed bytes a column, sign-extended) */
static inline __attribute__((always_inline)) vi i16_pair(const int fmt, const i16_block_t *B, int c, const int i) {
    if (fmt == CB_FMT_Q8_0) return (vi)__builtin_convertvector(*(const vpair8 *)(B->q + (i * CB_NR + c) * 2), vpair16);
    vi w = i16_shift(load_bits(B->q + ((i / 4) * CB_NR + c) * 4), -4 * (i % 4)) & I16_NIBBLES;
    if (fmt == CB_FMT_Q5_0 || fmt == CB_FMT_Q5_K)
        w |= i16_shift(load_bits(B->qh + c * 4), 4 - i) & I16_FIFTH;
    else if (fmt == CB_FMT_Q6_K)
        w |= i16_shift(load_bits(B->qh + ((i / 8) * CB_NR + c) * 4), 4 - 2 * (i % 8)) & I16_SIXTH;
    return w;
}

/* Repacking and the tiled path's decoding (panels_i16.c): a panel of base format fmt in the CB_FMT_I16 layout, k
 * values [k0, k0 + kn) as float32 [kn][48] into scratch (k0, kn multiples of CB_QK), as cb_panel_chunk. */
const float *cb_i16_chunk(int fmt, const uint8_t *panel, int k0, int kn, float *scratch);

#endif
