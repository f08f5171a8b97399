/* Few-row products on the 4-, 5- and 6-bit GGUF block formats with the rows rounded to int16 (the CB_FMT_I16
 * variants, cb_cpu.h): a decode step's products in integer multiply-adds, as llama.cpp's dot products are.
 *
 * rows.c decodes each weight to float32 in registers (mask, convert, a scale's FMA) before its FMA with the
 * row: on a CPU whose vector units are the limit (a 2-core Zen 4 streams a 1B model's 4-bit weights at a third
 * of its copy bandwidth so) those per-weight float operations are the cost. Here each row is rounded once per
 * call to int16 per block of 32 values (scale max|x| / 32767, so within 2^-16 of the block's largest value),
 * each weight byte's two values become one lane's two int16s (q of k = 2j low, k = 2j + 1 high) and one
 * pairwise multiply-add (AVX-512 VNNI's vpdpwssd; vpmaddwd + add without it) adds both products to 32-bit
 * integer sums, exact. A block's sums become float once: acc += (d sc) dx sum(q xq) + offset sum(x), the offset
 * term (-8d, m, -dmin m, -16d, -32 d sc) times the row's exact float sum over the block.
 *
 * The weights' bytes and the tiled path are CB_FMT_Q4_0's etc. (cb_storage_format); only the few-row products
 * differ, by the rounding of the rows. */
#include <math.h>
#include <stdlib.h>

#include "decode.h"

#define I16_RG 3 /* vectors per column group, as rows.c's */

/* acc + w.lo * x.lo + w.hi * x.hi per 32-bit lane, both halves int16 (x: one pair for every lane) */
static inline vi dot_pairs(vi acc, vi w, int32_t x) {
#if CB_VW == 16 && defined(__AVX512VNNI__)
    return (vi)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x));
#elif CB_VW == 16
    return acc + (vi)_mm512_madd_epi16((__m512i)w, _mm512_set1_epi32(x));
#elif CB_VW == 8 && defined(__AVXVNNI__)
    return (vi)_mm256_dpwssd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(x));
#elif CB_VW == 8
    return acc + (vi)_mm256_madd_epi16((__m256i)w, _mm256_set1_epi32(x));
#else
    const int32_t xl = (int16_t)(x & 0xffff), xh = x >> 16;
    return acc + (w & 0xffff) * xl + (w >> 16) * xh;
#endif
}

/* The rows rounded: per row, k / 2 pairs (xq), k / 32 block scales (dx) and k / 16 half-block sums of the row's
 * own values (sx). */
typedef struct {
    int32_t *xq;
    float *dx, *sx;
    int k;
} i16_rows_t;

static int i16_round(const float *a, int64_t lda, int m, int k, i16_rows_t *r) {
    r->k = k;
    r->xq = malloc(sizeof(int32_t) * (size_t)(m * k / 2) + sizeof(float) * (size_t)(m * (k / 32 + k / 16)));
    if (!r->xq) return CB_ENOMEM;
    r->dx = (float *)(r->xq + m * k / 2);
    r->sx = r->dx + m * (k / 32);
    for (int i = 0; i < m; ++i)
        for (int b = 0; b < k / CB_QK; ++b) {
            const float *x = a + (int64_t)i * lda + b * CB_QK;
            float amax = 0.0f, s0 = 0.0f, s1 = 0.0f;
            for (int t = 0; t < CB_QK; ++t) amax = fmaxf(amax, fabsf(x[t]));
            for (int t = 0; t < CB_QK / 2; ++t) s0 += x[t], s1 += x[t + CB_QK / 2];
            const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
            int32_t *xq = r->xq + (int64_t)i * (k / 2) + b * (CB_QK / 2);
            for (int j = 0; j < CB_QK / 2; ++j) {
                const int32_t lo = (int32_t)lrintf(x[2 * j] * inv), hi = (int32_t)lrintf(x[2 * j + 1] * inv);
                xq[j] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)hi << 16);
            }
            r->dx[i * (k / CB_QK) + b] = amax / 32767.0f;
            r->sx[i * (k / 16) + 2 * b] = s0;
            r->sx[i * (k / 16) + 2 * b + 1] = s1;
        }
    return CB_OK;
}

/* A block's integer sums into the float sums: acc += sums * (scale dx_i) + offset * (row i's sum of x) */
static inline __attribute__((always_inline)) void i16_flush(const int mr, vi sums[][I16_RG], const vf *scale,
                                                            const vf *offset, const i16_rows_t *r, int b, int half,
                                                            int halves, float *restrict acc_io, int col) {
    for (int i = 0; i < mr; ++i) {
        const float dx = r->dx[i * (r->k / CB_QK) + b];
        const float *sxp = r->sx + i * (r->k / 16) + 2 * b + half;
        const float sx = halves == 2 ? sxp[0] + sxp[1] : sxp[0];
        for (int v = 0; v < I16_RG; ++v) {
            float *at = acc_io + i * CB_NR + col + CB_VW * v;
            cb_store(at, cb_load(at) + to_float(sums[i][v]) * (scale[v] * dx) + offset[v] * sx);
            sums[i][v] = (vi){0};
        }
    }
}

/* The two values of byte pair (k = 2j low nibble, 2j + 1 high) as one lane's int16 pair: the high nibble moved to
 * bits 16-19 (one shift, one vpternlogd) */
static inline vi nibble_pairs(vi pair) { return (pair | pair << 12) & 0x000F000F; }
/* x shifted left by n (right by -n); n a constant once the loops are unrolled */
static inline vi shift_by(vi x, const int n) { return n >= 0 ? x << n : x >> -n; }
/* The high bits of a lane's pair from the byte h: bit (or bits) `at` of h to bit (bits) 4 of the low int16, bit(s)
 * `at + width` to bit(s) 4 of the high one (bits 20-): Q5's fifth bits (width 1, mask 0x00100010), Q6_K's two high
 * bits (width 2, 0x00300030). h is given spread (h | h << (16 - width), once for all the pairs its byte serves), so
 * each pair takes one shift and the mask (merged with its nibbles into one vpternlogd). */
static inline vi spread(vi h, const int width) { return h | h << (16 - width); }
static inline vi high_bits(vi spread_h, const int at, const int mask) { return shift_by(spread_h, 4 - at) & mask; }

/* Q4_0, Q4_1, Q5_0, Q4_K, Q5_K: 32 values per block and scale, a fifth bit from qh where `five` */
static inline __attribute__((always_inline)) void i16_q4(const int mr, const int fmt, const i16_rows_t *r,
                                                         const uint8_t *restrict panel, int col,
                                                         float *restrict acc_io) {
    const int kquant = fmt == CB_FMT_Q4_K || fmt == CB_FMT_Q5_K, five = fmt == CB_FMT_Q5_K || fmt == CB_FMT_Q5_0;
    vi sums[CB_ROWS_MAX][I16_RG] = {{{0}}};
    for (int b = 0; b < r->k / CB_QK; ++b) {
        const uint8_t *q, *qh = NULL;
        vf scale[I16_RG], offset[I16_RG];
        if (kquant) {
            const int64_t super = five ? Q5K_SUPER : Q4K_SUPER;
            const uint16_t *d = (const uint16_t *)kq_head(panel, super, b) + col;
            const uint8_t *blk = kq_block(panel, super, Q4K_HEAD, five ? Q5K_BLOCK : Q4K_BLOCK, b);
            q = blk + Q4K_Q + col;
            qh = blk + Q5K_QH + col;
            if (col == 0) prefetch_ahead(blk - (b % CB_KSUB ? 0 : Q4K_HEAD), (five ? Q5K_BLOCK : Q4K_BLOCK) + Q4K_HEAD);
            for (int v = 0; v < I16_RG; ++v) {
                scale[v] = q4_k_scale(half_value(d + CB_VW * v), blk + col + CB_VW * v);
                offset[v] = q4_k_offset(half_value(d + CB_NR + CB_VW * v), blk + CB_NR + col + CB_VW * v);
            }
        } else {
            const int bytes = fmt == CB_FMT_Q4_1 ? Q41_BLOCK_BYTES : fmt == CB_FMT_Q4_0 ? Q40_BLOCK_BYTES : Q50_BLOCK;
            const uint8_t *blk = panel + (int64_t)b * bytes;
            const uint16_t *d = (const uint16_t *)blk + col;
            q = blk + (fmt == CB_FMT_Q4_1 ? Q41_Q : Q40_Q) + col;
            qh = blk + Q50_QH + col;
            if (col == 0) prefetch_ahead(blk, bytes);
            for (int v = 0; v < I16_RG; ++v) {
                scale[v] = half_value(d + CB_VW * v);
                offset[v] = fmt == CB_FMT_Q4_1 ? half_value(d + CB_NR + CB_VW * v)
                                               : scale[v] * (fmt == CB_FMT_Q5_0 ? -16.0f : -8.0f);
            }
        }
#pragma GCC unroll 16 /* j % 4 a constant: the fifth bits' shifts */
        for (int j = 0; j < CB_QK / 2; ++j)
            for (int v = 0; v < I16_RG; ++v) {
                vi w = nibble_pairs(widen_u8(q + j * CB_NR + CB_VW * v));
                if (five) w |= high_bits(spread(widen_u8(qh + j / 4 * CB_NR + CB_VW * v), 1), 2 * (j % 4), 0x00100010);
                for (int i = 0; i < mr; ++i)
                    sums[i][v] = dot_pairs(sums[i][v], w, r->xq[i * (r->k / 2) + b * (CB_QK / 2) + j]);
            }
        i16_flush(mr, sums, scale, offset, r, b, 0, 2, acc_io, col);
    }
}

/* Q6_K: a scale per 16 values, so each half block is flushed on its own */
static inline __attribute__((always_inline)) void i16_q6_k(const int mr, const i16_rows_t *r,
                                                           const uint8_t *restrict panel, int col,
                                                           float *restrict acc_io) {
    vi sums[CB_ROWS_MAX][I16_RG] = {{{0}}};
    for (int b = 0; b < r->k / CB_QK; ++b) {
        const uint16_t *d = (const uint16_t *)kq_head(panel, Q6K_SUPER, b) + col;
        const uint8_t *blk = kq_block(panel, Q6K_SUPER, Q6K_HEAD, Q6K_BLOCK, b);
        const int8_t *sc = (const int8_t *)blk + col;
        if (col == 0) prefetch_ahead(blk - (b % CB_KSUB ? 0 : Q6K_HEAD), Q6K_BLOCK + Q6K_HEAD);
        for (int half = 0; half < 2; ++half) {
            vf scale[I16_RG], offset[I16_RG];
            for (int v = 0; v < I16_RG; ++v) {
                scale[v] = q6_k_scale(half_value(d + CB_VW * v), sc + half * CB_NR + CB_VW * v);
                offset[v] = q6_k_offset(scale[v]);
            }
#pragma GCC unroll 8 /* j & 1 a constant: which bits of h */
            for (int j = half * CB_QK / 4; j < (half + 1) * CB_QK / 4; ++j)
                for (int v = 0; v < I16_RG; ++v) {
                    const vi h = spread(widen_u8(blk + Q6K_QH + j / 2 * CB_NR + col + CB_VW * v), 2);
                    const vi w = nibble_pairs(widen_u8(blk + Q6K_QL + j * CB_NR + col + CB_VW * v)) |
                                 high_bits(h, 4 * (j & 1), 0x00300030);
                    for (int i = 0; i < mr; ++i)
                        sums[i][v] = dot_pairs(sums[i][v], w, r->xq[i * (r->k / 2) + b * (CB_QK / 2) + j]);
                }
            i16_flush(mr, sums, scale, offset, r, b, half, 1, acc_io, col);
        }
    }
}

static inline __attribute__((always_inline)) void i16_panel_fmt(const int mr, const int fmt, const i16_rows_t *r,
                                                                const uint8_t *panel, float *acc_io) {
    for (int col = 0; col < CB_NR; col += I16_RG * CB_VW) {
        if (fmt == CB_FMT_Q6_K)
            i16_q6_k(mr, r, panel, col, acc_io);
        else
            i16_q4(mr, fmt, r, panel, col, acc_io);
    }
}

static inline __attribute__((always_inline)) void i16_panel_mr(const int mr, int fmt, const i16_rows_t *r,
                                                               const uint8_t *panel, float *acc_io) {
    switch (fmt) {
    case CB_FMT_Q4_0: i16_panel_fmt(mr, CB_FMT_Q4_0, r, panel, acc_io); break;
    case CB_FMT_Q4_1: i16_panel_fmt(mr, CB_FMT_Q4_1, r, panel, acc_io); break;
    case CB_FMT_Q5_0: i16_panel_fmt(mr, CB_FMT_Q5_0, r, panel, acc_io); break;
    case CB_FMT_Q4_K: i16_panel_fmt(mr, CB_FMT_Q4_K, r, panel, acc_io); break;
    case CB_FMT_Q5_K: i16_panel_fmt(mr, CB_FMT_Q5_K, r, panel, acc_io); break;
    default: i16_panel_fmt(mr, CB_FMT_Q6_K, r, panel, acc_io); break;
    }
}

static void i16_panel(int mr, int fmt, const void *rows, const uint8_t *panel, float *acc_io) {
    const i16_rows_t *r = rows;
    switch (mr) {
    case 1: i16_panel_mr(1, fmt, r, panel, acc_io); break;
    case 2: i16_panel_mr(2, fmt, r, panel, acc_io); break;
    case 3: i16_panel_mr(3, fmt, r, panel, acc_io); break;
    default: i16_panel_mr(4, fmt, r, panel, acc_io); break;
    }
}

int cb_rows_i16_take(int fmt, int m, int k) {
    const int s = cb_storage_format(fmt);
    const int nibbles = s == CB_FMT_Q4_0 || s == CB_FMT_Q4_1 || s == CB_FMT_Q5_0 || s == CB_FMT_Q4_K ||
                        s == CB_FMT_Q5_K || s == CB_FMT_Q6_K; /* the formats i16_panel reads */
    return (fmt & CB_FMT_I16) && nibbles && cb_rows_take(s, m, k);
}

int cb_linear_rows_i16(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                       const float *bias, float *c, int64_t ldc) {
    fmt = cb_storage_format(fmt);
    i16_rows_t r;
    const int rc = i16_round(a, lda, m, k, &r);
    if (rc != CB_OK) return rc;
    cb_rows_over_panels(fmt, m, k, wp, n, bias, c, ldc, i16_panel, &r);
    free(r.xq);
    return CB_OK;
}
