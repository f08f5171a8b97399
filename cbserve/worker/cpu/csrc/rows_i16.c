/* Few-row products on the 4-, 5- and 6-bit GGUF block formats with the rows rounded to int16 (the CB_FMT_I16
 * variants, cb_cpu.h): a decode step's products in integer multiply-adds, as llama.cpp's dot products are.
 *
 * rows.c decodes each weight to float32 in registers (mask, convert, a scale's FMA) before its FMA with the
 * row: on a CPU whose vector units are the limit (a 2-core Zen 4 streams a 1B model's 4-bit weights at a third
 * of its copy bandwidth so) those per-weight float operations are the cost. Here each row is rounded once per
 * call to int16 per block of 32 values (scale max|x| / 32767, so within 2^-16 of the block's largest value);
 * the weights are stored as int16 pairs (the CB_FMT_I16 layouts, i16.h: one full-width load of a column group's
 * dwords gives 8 k values, each pair of them a shift and an and away from a lane's two int16s, q of k = 2i low,
 * 2i + 1 high) and one pairwise multiply-add (AVX-512 VNNI's vpdpwssd; vpmaddwd + add without it) adds both
 * products to 32-bit integer sums, exact: about 3 instructions per 32 weights and row. A block's sums become
 * float once: acc += (d sc) dx sum(q xq) + offset sum(x), the offset term (-8d, m, -dmin m, -16d, -32 d sc)
 * times the row's exact float sum over the block.
 *
 * More rows take the tiled path, which decodes the same layout to the format's float32 weights (panels_i16.c):
 * only the few-row products differ, by the rounding of the rows. */
#include <math.h>
#include <stdlib.h>

#include "i16.h"

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
    return acc + ((w << 16) >> 16) * xl + (w >> 16) * xh; /* signed halves (Q8_0's) */
#endif
}

/* The rows rounded: per row, k / 2 pairs (xq), k / 32 block scales (dx) and k / 16 half-block sums of the row's
 * own values (sx). */
typedef struct {
    int32_t *xq;
    float *dx, *sx;
    int k;
} i16_rows_t;

static void i16_round_row(const float *a, int k, int32_t *xq, float *dx, float *sx) {
    for (int b = 0; b < k / CB_QK; ++b) {
        const float *x = a + b * CB_QK;
        float amax = 0.0f, s0 = 0.0f, s1 = 0.0f;
        for (int t = 0; t < CB_QK; ++t) amax = fmaxf(amax, fabsf(x[t]));
        for (int t = 0; t < CB_QK / 2; ++t) s0 += x[t], s1 += x[t + CB_QK / 2];
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t *q = xq + b * (CB_QK / 2);
        for (int j = 0; j < CB_QK / 2; ++j) {
            const int32_t lo = (int32_t)lrintf(x[2 * j] * inv), hi = (int32_t)lrintf(x[2 * j + 1] * inv);
            q[j] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)hi << 16);
        }
        dx[b] = amax / 32767.0f;
        sx[2 * b] = s0;
        sx[2 * b + 1] = s1;
    }
}

static int i16_round(const float *a, int64_t lda, int m, int k, i16_rows_t *r) {
    r->k = k;
    const size_t rows = (size_t)m;
    r->xq = malloc(sizeof(int32_t) * rows * (size_t)(k / 2) + sizeof(float) * rows * (size_t)(k / 32 + k / 16));
    if (!r->xq) return CB_ENOMEM;
    r->dx = (float *)(r->xq + (int64_t)m * (k / 2));
    r->sx = r->dx + (int64_t)m * (k / 32);
#pragma omp parallel for schedule(static) if (m > CB_ROWS_MAX)
    for (int i = 0; i < m; ++i)
        i16_round_row(a + (int64_t)i * lda, k, r->xq + (int64_t)i * (k / 2), r->dx + (int64_t)i * (k / CB_QK),
                      r->sx + (int64_t)i * (k / 16));
    return CB_OK;
}

/* Rows [t, t + ...) of the rounded rows, as rows of their own */
static i16_rows_t i16_tile(const i16_rows_t *r, int t) {
    const i16_rows_t v = {r->xq + (int64_t)t * (r->k / 2), r->dx + (int64_t)t * (r->k / CB_QK),
                          r->sx + (int64_t)t * (r->k / 16), r->k};
    return v;
}

/* A column group's float sums: acc_io ([mr][48], the panel's) and, over a K-quant super-block, its sums before the
 * super-block's scales d (ks) and dmin (km), which go to acc_io once a super-block. Formats of one scale a block
 * (Q4_0, Q4_1, Q5_0) keep acc_io's sums themselves in ks over the whole group: the same additions in the same
 * order, in registers instead of a store and a load a block (Q4_0 on Llama-3.2-1B's shapes, 2-core Zen 4, two runs
 * each: 4 rows 248-261 -> 273-274 GFLOP/s, 16 rows 318-321 -> 335-339). */
typedef struct {
    vf ks[CB_ROWS_MAX][I16_RG], km[CB_ROWS_MAX][I16_RG];
} i16_super_t;

/* Block b's (half = -1) or a Q6_K half block's (half 0, 1) integer sums into float. With s = sums dx (dx: the row's
 * step) and x the row's float sum over those values: Q4_0, Q5_0: ks += d (s + c x), c = -8, -16; Q4_1: ks += d s +
 * m x; Q4_K, Q5_K: ks += sc s, km += m x; Q6_K: ks += sc (s - 32 x). The scales are the formats' (i16_scales) with
 * d and dmin moved out of the K-quants' blocks: fewer float operations a block, the same products up to rounding. */
static inline __attribute__((always_inline)) void i16_flush(const int mr, const int fmt, vi sums[][I16_RG],
                                                            const i16_block_t *B, const i16_rows_t *r, int b,
                                                            const int half, int col, i16_super_t *S) {
    const int k45 = fmt == CB_FMT_Q4_K || fmt == CB_FMT_Q5_K;
    const float c = fmt == CB_FMT_Q5_0 ? -16.0f : fmt == CB_FMT_Q6_K ? -32.0f : -8.0f;
    vf f[I16_RG], g[I16_RG];
    for (int v = 0; v < I16_RG; ++v) {
        const int at = col + CB_VW * v;
        if (k45) {
            f[v] = to_float(widen_u8(B->sub + at));
            g[v] = to_float(widen_u8(B->sub + CB_NR + at));
        } else if (fmt == CB_FMT_Q6_K) {
            f[v] = to_float(widen_s8((const int8_t *)B->sub + half * CB_NR + at));
        } else {
            f[v] = half_value(B->d + at);
            g[v] = fmt == CB_FMT_Q4_1 ? half_value(B->d + CB_NR + at) : f[v];
        }
    }
    for (int i = 0; i < mr; ++i) {
        const float dx = r->dx[i * (r->k / CB_QK) + b];
        const float *sxp = r->sx + i * (r->k / 16) + 2 * b;
        const float sx = half < 0 ? sxp[0] + sxp[1] : sxp[half];
        for (int v = 0; v < I16_RG; ++v) {
            const vf s = to_float(sums[i][v]) * dx;
            sums[i][v] = (vi){0};
            if (k45) {
                S->ks[i][v] += f[v] * s;
                S->km[i][v] += g[v] * sx;
            } else if (fmt == CB_FMT_Q6_K) {
                S->ks[i][v] += f[v] * (s + c * sx);
            } else {
                S->ks[i][v] += fmt == CB_FMT_Q4_1   ? f[v] * s + g[v] * sx
                               : fmt == CB_FMT_Q8_0 ? f[v] * s
                                                    : f[v] * (s + c * sx);
            }
        }
    }
}

/* The end of a K-quant super-block: acc += d ks - dmin km (Q6_K: d ks) */
static inline __attribute__((always_inline)) void i16_super_flush(const int mr, const int fmt, const i16_block_t *B,
                                                                  int col, i16_super_t *S, float *restrict acc_io) {
    for (int v = 0; v < I16_RG; ++v) {
        const vf d = half_value(B->d + col + CB_VW * v);
        const vf dmin = fmt == CB_FMT_Q6_K ? (vf){0} : half_value(B->d + CB_NR + col + CB_VW * v);
        for (int i = 0; i < mr; ++i) {
            float *at = acc_io + i * CB_NR + col + CB_VW * v;
            cb_store(at, cb_load(at) + d * S->ks[i][v] - dmin * S->km[i][v]);
            S->ks[i][v] = S->km[i][v] = (vf){0};
        }
    }
}

/* Pairs [i0, i1) of block b against rows [0, mr): one load-shift-and per pair and CB_VW columns (i16.h), then one
 * pairwise multiply-add per row */
static inline __attribute__((always_inline)) void i16_pairs(const int mr, const int fmt, const i16_rows_t *r,
                                                            const i16_block_t *B, int b, const int i0, const int i1,
                                                            int col, vi sums[][I16_RG]) {
#pragma GCC unroll 16 /* i a constant: the shifts */
    for (int i = i0; i < i1; ++i)
        for (int v = 0; v < I16_RG; ++v) {
            const vi w = i16_pair(fmt, B, col + CB_VW * v, i);
            for (int row = 0; row < mr; ++row)
                sums[row][v] = dot_pairs(sums[row][v], w, r->xq[row * (r->k / 2) + b * I16_PAIRS + i]);
        }
}

/* Columns [col, col + I16_RG * CB_VW) of one panel over all of k: each block's integer sums, flushed to float once a
 * block (Q6_K: once a half block, a scale per 16 values: pairs 0-7, then 8-15) */
static inline __attribute__((always_inline)) void i16_group(const int mr, const int fmt, const i16_rows_t *r,
                                                            const uint8_t *restrict panel, int col,
                                                            float *restrict acc_io) {
    vi sums[CB_ROWS_MAX][I16_RG] = {{{0}}};
    i16_super_t S = {{{{0}}}, {{{0}}}};
    const int flat = !cb_kquant(fmt) || fmt == CB_FMT_Q5_0; /* one scale a block: the sums go straight to ks */
    if (flat)
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < I16_RG; ++v) S.ks[i][v] = cb_load(acc_io + i * CB_NR + col + CB_VW * v);
    for (int b = 0; b < r->k / CB_QK; ++b) {
        const i16_block_t B = i16_block(fmt, panel, b);
        if (col == 0) prefetch_ahead(B.start, B.bytes);
        if (fmt == CB_FMT_Q6_K) {
            i16_pairs(mr, fmt, r, &B, b, 0, I16_PAIRS / 2, col, sums);
            i16_flush(mr, fmt, sums, &B, r, b, 0, col, &S);
            i16_pairs(mr, fmt, r, &B, b, I16_PAIRS / 2, I16_PAIRS, col, sums);
            i16_flush(mr, fmt, sums, &B, r, b, 1, col, &S);
        } else {
            i16_pairs(mr, fmt, r, &B, b, 0, I16_PAIRS, col, sums);
            i16_flush(mr, fmt, sums, &B, r, b, -1, col, &S);
        }
        if (!flat && b % CB_KSUB == CB_KSUB - 1) i16_super_flush(mr, fmt, &B, col, &S, acc_io);
    }
    if (flat)
        for (int i = 0; i < mr; ++i)
            for (int v = 0; v < I16_RG; ++v) cb_store(acc_io + i * CB_NR + col + CB_VW * v, S.ks[i][v]);
}

static inline __attribute__((always_inline)) void i16_panel_fmt(const int mr, const int fmt, const i16_rows_t *r,
                                                                const uint8_t *panel, float *acc_io) {
    for (int col = 0; col < CB_NR; col += I16_RG * CB_VW) i16_group(mr, fmt, r, panel, col, acc_io);
}

static inline __attribute__((always_inline)) void i16_panel_mr(const int mr, int fmt, const i16_rows_t *r,
                                                               const uint8_t *panel, float *acc_io) {
    switch (fmt) {
    case CB_FMT_Q4_0: i16_panel_fmt(mr, CB_FMT_Q4_0, r, panel, acc_io); break;
    case CB_FMT_Q4_1: i16_panel_fmt(mr, CB_FMT_Q4_1, r, panel, acc_io); break;
    case CB_FMT_Q5_0: i16_panel_fmt(mr, CB_FMT_Q5_0, r, panel, acc_io); break;
    case CB_FMT_Q4_K: i16_panel_fmt(mr, CB_FMT_Q4_K, r, panel, acc_io); break;
    case CB_FMT_Q5_K: i16_panel_fmt(mr, CB_FMT_Q5_K, r, panel, acc_io); break;
    case CB_FMT_Q8_0: i16_panel_fmt(mr, CB_FMT_Q8_0, r, panel, acc_io); break;
    default: i16_panel_fmt(mr, CB_FMT_Q6_K, r, panel, acc_io); break;
    }
}

static void i16_panel(int mr, int fmt, const void *rows, int row0, const uint8_t *panel, float *acc_io) {
    const i16_rows_t tile = i16_tile(rows, row0), *r = &tile;
    switch (mr) {
    case 1: i16_panel_mr(1, fmt, r, panel, acc_io); break;
    case 2: i16_panel_mr(2, fmt, r, panel, acc_io); break;
    case 3: i16_panel_mr(3, fmt, r, panel, acc_io); break;
    default: i16_panel_mr(4, fmt, r, panel, acc_io); break;
    }
}

int cb_rows_i16_take(int fmt, int m, int k) {
    const int base = fmt & ~CB_FMT_I16ALL;
    if (!(fmt & CB_FMT_I16) || !cb_i16_format(base)) return 0;
    if ((fmt & CB_FMT_I16ALL) == CB_FMT_I16ALL && CB_I16_DOT) return m >= 1 && cb_rows_take(base, 1, k);
    return cb_rows_take(base, m, k);
}

/* Every row of a step (CB_FMT_I16ALL): each panel meets the rows a tile of I16_TILE at a time, the panel staying in
 * L2 while its tiles go by */
#if CB_VW == 16
#define I16_TILE 4
#else
#define I16_TILE 2 /* AVX2: 16 vector registers */
#endif

int cb_linear_rows_i16(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                       const float *bias, float *c, int64_t ldc) {
    const int all = (fmt & CB_FMT_I16ALL) == CB_FMT_I16ALL;
    fmt &= ~CB_FMT_I16ALL; /* i16_panel's switch: the base format, read in its I16 layout */
    i16_rows_t r;
    const int rc = i16_round(a, lda, m, k, &r);
    if (rc != CB_OK) return rc;
    cb_rows_over_panels(fmt, m, k, wp, n, bias, c, ldc, i16_panel, &r, all ? I16_TILE : m);
    free(r.xq);
    return CB_OK;
}
