/* Products of a few rows, C[m, N] = A[m, K] @ W[N, K]^T (+ bias) for m <= CB_ROWS_MAX, straight from the
 * packed weights: a decode step's rows (one per running request). The tiled path (gemm.c) decodes each chunk
 * of a panel into a float32 scratch and reads it back, which pays when many rows share the decoded chunk; with
 * a few rows that round trip, not the multiply, is the cost. Here each weight vector is decoded in registers
 * (decode.h, the expressions the scratch decoder uses) and multiplied into every row's sums at once, so each
 * packed byte is read once and nothing is written but C.
 *
 * Same bits as the tiled path: every C element is one dot product summed in k order from the bias (or zero)
 * by one thread, with the same float32 weights. A panel's 48 columns go in groups of CB_RG vectors (the
 * whole panel with AVX-512), each group over all of k with its sums in registers, then the next group (its
 * bytes are in cache by then: a panel is at most tens of KB). Work items are panels, shared as gemm.c shares. */
#include "decode.h"

/* vectors per column group: 3 (48 columns with AVX-512, 24 with AVX2, 12 with the portable build's 4 lanes) */
#define CB_RG 3
/* The most rows this path takes at this level. Against the tiled path on a 2-core Xeon (Cascade Lake), SmolLM2's
 * 30 layers' weights streamed from memory (benchmarks/bench_linear.py --layers 30): AVX-512 1.33x / 1.25x /
 * 1.14x / 1.09x at 1-4 rows; AVX2 1.11x / 1.07x at 1-2 rows, where with 16 registers 3 and 4 rows spill their
 * sums (1.07x and 1.03x on one 80 MB product, slower than the tiled path on weights already in cache). */
#if CB_VW == 16
#define CB_ROWS_TAKE 4
#else
#define CB_ROWS_TAKE 2
#endif

#define CB_ROWS_K(i, kk) a[(int64_t)(i) * lda + (kk)]

/* Each format's loop over all of k for rows [0, mr) and one column group: acc[i][v] += A[i, kk] * W[kk, v-th
 * vector of the group], kk in order. panel: the panel's first block (or row); col: the group's first column. */
#define CB_ROWS_ADD(x, w)                                                                            \
    for (int i = 0; i < mr; ++i) acc[i][v] = cb_settled(acc[i][v] + CB_ROWS_K(i, x) * (w))

/* Q4_1 (q41 = 1: scales d and m) or Q4_0 (q41 = 0: d, and m = -8d), one byte holding k = 2j and 2j + 1 */
static inline __attribute__((always_inline)) void rows_q4(const int mr, const int q41, vf acc[][CB_RG],
                                                          const float *restrict a, int64_t lda, int k,
                                                          const uint8_t *restrict panel, int col) {
    const int bytes = q41 ? Q41_BLOCK_BYTES : Q40_BLOCK_BYTES;
    for (int b = 0; b < k / CB_QK; ++b, panel += bytes) {
        const uint16_t *d = (const uint16_t *)panel + col;
        const uint8_t *q = panel + (q41 ? Q41_Q : Q40_Q) + col;
        if (col == 0) prefetch_ahead(panel, bytes);
        vf dv[CB_RG], mv[CB_RG];
        for (int v = 0; v < CB_RG; ++v) {
            dv[v] = half_value(d + CB_VW * v);
            mv[v] = q41 ? half_value(d + CB_NR + CB_VW * v) : q4_0_offset(dv[v]);
        }
        for (int j = 0; j < CB_QK / 2; ++j)
            for (int v = 0; v < CB_RG; ++v) {
                const vi pair = widen_u8(q + j * CB_NR + CB_VW * v);
                const vf lo = cb_settled(q4_1_low(dv[v], mv[v], pair));
                const vf hi = cb_settled(q4_1_high(dv[v], mv[v], pair));
                CB_ROWS_ADD(b * CB_QK + 2 * j, lo);
                CB_ROWS_ADD(b * CB_QK + 2 * j + 1, hi);
            }
    }
}

static inline __attribute__((always_inline)) void rows_q8_0(const int mr, vf acc[][CB_RG], const float *restrict a,
                                                            int64_t lda, int k, const uint8_t *restrict panel,
                                                            int col) {
    for (int b = 0; b < k / CB_QK; ++b, panel += Q8_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)panel + col;
        const int8_t *q = (const int8_t *)(panel + Q8_Q) + col;
        if (col == 0) prefetch_ahead(panel, Q8_BLOCK_BYTES);
        vf dv[CB_RG];
        for (int v = 0; v < CB_RG; ++v) dv[v] = half_value(d + CB_VW * v);
        for (int j = 0; j < CB_QK; ++j)
            for (int v = 0; v < CB_RG; ++v) {
                const vf w = cb_settled(q8_0_value(dv[v], q + j * CB_NR + CB_VW * v));
                CB_ROWS_ADD(b * CB_QK + j, w);
            }
    }
}

/* The K-quants: each block's scales from its super-block's header and its own sub-scales (decode.h) */
/* Q4_K (five = 0) or Q5_K (1) */
static inline __attribute__((always_inline)) void rows_q45_k(const int mr, const int five, vf acc[][CB_RG],
                                                             const float *restrict a, int64_t lda, int k,
                                                             const uint8_t *restrict panel, int col) {
    const int64_t super = five ? Q5K_SUPER : Q4K_SUPER;
    const int bytes = five ? Q5K_BLOCK : Q4K_BLOCK;
    for (int b = 0; b < k / CB_QK; ++b) {
        const uint16_t *d = (const uint16_t *)kq_head(panel, super, b) + col;
        const uint8_t *blk = kq_block(panel, super, Q4K_HEAD, bytes, b), *q = blk + Q4K_Q + col;
        if (col == 0) prefetch_ahead(blk - (b % CB_KSUB ? 0 : Q4K_HEAD), bytes + Q4K_HEAD);
        vf dv[CB_RG], mv[CB_RG];
        for (int v = 0; v < CB_RG; ++v) {
            dv[v] = q4_k_scale(half_value(d + CB_VW * v), blk + col + CB_VW * v);
            mv[v] = q4_k_offset(half_value(d + CB_NR + CB_VW * v), blk + CB_NR + col + CB_VW * v);
        }
        for (int j = 0; j < CB_QK / 2; ++j)
            for (int v = 0; v < CB_RG; ++v) {
                const vi pair = widen_u8(q + j * CB_NR + CB_VW * v);
                vi ql = pair & 15, qh = pair >> 4;
                if (five) {
                    const vi h4 = widen_u8(blk + Q5K_QH + j / 4 * CB_NR + col + CB_VW * v) << 4;
                    ql = q5_low(pair, h4, j);
                    qh = q5_high(pair, h4, j);
                }
                const vf lo = cb_settled(dv[v] * to_float(ql) + mv[v]);
                const vf hi = cb_settled(dv[v] * to_float(qh) + mv[v]);
                CB_ROWS_ADD(b * CB_QK + 2 * j, lo);
                CB_ROWS_ADD(b * CB_QK + 2 * j + 1, hi);
            }
    }
}

/* Q5_0: d (q - 16) as d q + (-16 d), Q4_0's way: exact but for the sign of a zero */
static inline __attribute__((always_inline)) void rows_q5_0(const int mr, vf acc[][CB_RG], const float *restrict a,
                                                            int64_t lda, int k, const uint8_t *restrict panel,
                                                            int col) {
    for (int b = 0; b < k / CB_QK; ++b, panel += Q50_BLOCK) {
        if (col == 0) prefetch_ahead(panel, Q50_BLOCK);
        vf dv[CB_RG], mv[CB_RG];
        for (int v = 0; v < CB_RG; ++v) {
            dv[v] = half_value((const uint16_t *)panel + col + CB_VW * v);
            mv[v] = dv[v] * -16.0f;
        }
        for (int j = 0; j < CB_QK / 2; ++j)
            for (int v = 0; v < CB_RG; ++v) {
                const vi pair = widen_u8(panel + Q50_Q + j * CB_NR + col + CB_VW * v);
                const vi h4 = widen_u8(panel + Q50_QH + j / 4 * CB_NR + col + CB_VW * v) << 4;
                const vf lo = cb_settled(dv[v] * to_float(q5_low(pair, h4, j)) + mv[v]);
                const vf hi = cb_settled(dv[v] * to_float(q5_high(pair, h4, j)) + mv[v]);
                CB_ROWS_ADD(b * CB_QK + 2 * j, lo);
                CB_ROWS_ADD(b * CB_QK + 2 * j + 1, hi);
            }
    }
}

static inline __attribute__((always_inline)) void rows_q6_k(const int mr, vf acc[][CB_RG], const float *restrict a,
                                                            int64_t lda, int k, const uint8_t *restrict panel,
                                                            int col) {
    for (int b = 0; b < k / CB_QK; ++b) {
        const uint16_t *d = (const uint16_t *)kq_head(panel, Q6K_SUPER, b) + col;
        const uint8_t *blk = kq_block(panel, Q6K_SUPER, Q6K_HEAD, Q6K_BLOCK, b);
        const int8_t *sc = (const int8_t *)blk + col;
        if (col == 0) prefetch_ahead(blk - (b % CB_KSUB ? 0 : Q6K_HEAD), Q6K_BLOCK + Q6K_HEAD);
        vf s0[CB_RG], s1[CB_RG], o0[CB_RG], o1[CB_RG];
        for (int v = 0; v < CB_RG; ++v) {
            const vf dv = half_value(d + CB_VW * v);
            s0[v] = q6_k_scale(dv, sc + CB_VW * v);
            s1[v] = q6_k_scale(dv, sc + CB_NR + CB_VW * v);
            o0[v] = q6_k_offset(s0[v]);
            o1[v] = q6_k_offset(s1[v]);
        }
        for (int j = 0; j < CB_QK / 2; ++j)
            for (int v = 0; v < CB_RG; ++v) {
                const vi pair = widen_u8(blk + Q6K_QL + j * CB_NR + col + CB_VW * v);
                const vi h = widen_u8(blk + Q6K_QH + j / 2 * CB_NR + col + CB_VW * v);
                const vf s = j < CB_QK / 4 ? s0[v] : s1[v], off = j < CB_QK / 4 ? o0[v] : o1[v];
                const vf lo = cb_settled(q6_k_low(s, off, pair, h, 4 * (j & 1)));
                const vf hi = cb_settled(q6_k_high(s, off, pair, h, 4 * (j & 1)));
                CB_ROWS_ADD(b * CB_QK + 2 * j, lo);
                CB_ROWS_ADD(b * CB_QK + 2 * j + 1, hi);
            }
    }
}

/* bfloat16 (wide = 0) or float32 (wide = 1) panels: [k][48] values, read in place */
static inline __attribute__((always_inline)) void rows_plain(const int mr, const int wide, vf acc[][CB_RG],
                                                             const float *restrict a, int64_t lda, int k,
                                                             const uint8_t *restrict panel, int col) {
    for (int kk = 0; kk < k; ++kk)
        for (int v = 0; v < CB_RG; ++v) {
            const int64_t at = (int64_t)kk * CB_NR + col + CB_VW * v;
            CB_ROWS_ADD(kk, wide ? cb_load((const float *)panel + at) : bf16_value((const uint16_t *)panel + at));
        }
}

/* The sums of rows [0, mr) of A against columns [col, col + CB_RG * CB_VW) of one panel, in acc_io ([mr][48],
 * holding the starting values) and back. */
static inline __attribute__((always_inline)) void rows_group(const int mr, int fmt, const float *restrict a,
                                                             int64_t lda, int k, const uint8_t *restrict panel,
                                                             int col, float *restrict acc_io) {
    vf acc[CB_ROWS_MAX][CB_RG];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < CB_RG; ++v) acc[i][v] = cb_load(acc_io + i * CB_NR + col + CB_VW * v);
    if (fmt == CB_FMT_Q4_1 || fmt == CB_FMT_Q4_0)
        rows_q4(mr, fmt == CB_FMT_Q4_1, acc, a, lda, k, panel, col);
    else if (fmt == CB_FMT_Q8_0)
        rows_q8_0(mr, acc, a, lda, k, panel, col);
    else if (fmt == CB_FMT_Q4_K || fmt == CB_FMT_Q5_K)
        rows_q45_k(mr, fmt == CB_FMT_Q5_K, acc, a, lda, k, panel, col);
    else if (fmt == CB_FMT_Q5_0)
        rows_q5_0(mr, acc, a, lda, k, panel, col);
    else if (fmt == CB_FMT_Q6_K)
        rows_q6_k(mr, acc, a, lda, k, panel, col);
    else
        rows_plain(mr, fmt == CB_FMT_F32, acc, a, lda, k, panel, col);
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < CB_RG; ++v) cb_store(acc_io + i * CB_NR + col + CB_VW * v, acc[i][v]);
}

/* A whole panel, group by group; mr and the format as compile-time constants in each case of the switches. */
static inline __attribute__((always_inline)) void rows_panel_fmt(const int mr, const int fmt, const float *a,
                                                                 int64_t lda, int k, const uint8_t *panel,
                                                                 float *acc_io) {
    for (int col = 0; col < CB_NR; col += CB_RG * CB_VW) rows_group(mr, fmt, a, lda, k, panel, col, acc_io);
}

static inline __attribute__((always_inline)) void rows_panel_mr(const int mr, int fmt, const float *a, int64_t lda,
                                                                int k, const uint8_t *panel, float *acc_io) {
    switch (fmt) {
    case CB_FMT_Q4_1: rows_panel_fmt(mr, CB_FMT_Q4_1, a, lda, k, panel, acc_io); break;
    case CB_FMT_Q4_0: rows_panel_fmt(mr, CB_FMT_Q4_0, a, lda, k, panel, acc_io); break;
    case CB_FMT_Q8_0: rows_panel_fmt(mr, CB_FMT_Q8_0, a, lda, k, panel, acc_io); break;
    case CB_FMT_Q4_K: rows_panel_fmt(mr, CB_FMT_Q4_K, a, lda, k, panel, acc_io); break;
    case CB_FMT_Q5_K: rows_panel_fmt(mr, CB_FMT_Q5_K, a, lda, k, panel, acc_io); break;
    case CB_FMT_Q5_0: rows_panel_fmt(mr, CB_FMT_Q5_0, a, lda, k, panel, acc_io); break;
    case CB_FMT_Q6_K: rows_panel_fmt(mr, CB_FMT_Q6_K, a, lda, k, panel, acc_io); break;
    case CB_FMT_BF16: rows_panel_fmt(mr, CB_FMT_BF16, a, lda, k, panel, acc_io); break;
    default: rows_panel_fmt(mr, CB_FMT_F32, a, lda, k, panel, acc_io); break;
    }
}

static void rows_panel(int mr, int fmt, const float *a, int64_t lda, int k, const uint8_t *panel, float *acc_io) {
    switch (mr) {
    case 1: rows_panel_mr(1, fmt, a, lda, k, panel, acc_io); break;
    case 2: rows_panel_mr(2, fmt, a, lda, k, panel, acc_io); break;
    case 3: rows_panel_mr(3, fmt, a, lda, k, panel, acc_io); break;
    default: rows_panel_mr(4, fmt, a, lda, k, panel, acc_io); break;
    }
}

static int rows_enabled = 1;

int cb_set_rows(int enable) { return __atomic_exchange_n(&rows_enabled, enable != 0, __ATOMIC_RELAXED); }

int cb_rows_take(int fmt, int m, int k) {
    const int blocks = fmt == CB_FMT_Q8_0 || fmt == CB_FMT_Q4_1 || fmt == CB_FMT_Q4_0;
    const int fits = fmt == CB_FMT_F32 || fmt == CB_FMT_BF16 || (blocks && k % CB_QK == 0) ||
                     (cb_kquant(fmt) && k % (fmt == CB_FMT_Q5_0 ? CB_QK : CB_QKK) == 0);
    return fits && m >= 1 && m <= CB_ROWS_TAKE && __atomic_load_n(&rows_enabled, __ATOMIC_RELAXED) != 0;
}

void cb_rows_over_panels(int fmt, int m, int k, const uint8_t *wp, int n, const float *bias, float *c, int64_t ldc,
                         cb_rows_panel_fn panel_fn, const void *rows, int tile) {
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    const int panels = (n + CB_NR - 1) / CB_NR;
    cb_share_t shares[CB_MAX_SHARES];
    const int nshares = cb_shares_init(shares, panels);
#pragma omp parallel
    {
        float acc[CB_ROWS_MAX * CB_NR] __attribute__((aligned(64)));
        for (int p; (p = cb_share_next(shares, nshares)) >= 0;) {
            const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
            float tail_bias[CB_NR];
            const float *b = cb_item_bias(bias, p, ncols, tail_bias);
            for (int t = 0; t < m; t += tile) {
                const int mr = m - t < tile ? m - t : tile;
                for (int i = 0; i < mr; ++i)
                    for (int j = 0; j < CB_NR; ++j) acc[i * CB_NR + j] = b ? b[j] : 0.0f;
                panel_fn(mr, fmt, rows, t, wp + p * pbytes, acc);
                for (int i = 0; i < mr; ++i)
                    memcpy(c + (int64_t)(t + i) * ldc + p * CB_NR, acc + i * CB_NR, sizeof(float) * (size_t)ncols);
            }
        }
    }
}

/* the float32 rows of cb_linear_rows, for rows_over_panels */
typedef struct {
    const float *a;
    int64_t lda;
    int k;
} float_rows_t;

static void float_rows_panel(int mr, int fmt, const void *rows, int row0, const uint8_t *panel, float *acc_io) {
    const float_rows_t *r = rows;
    rows_panel(mr, fmt, r->a + (int64_t)row0 * r->lda, r->lda, r->k, panel, acc_io);
}

void cb_linear_rows(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                    const float *bias, float *c, int64_t ldc) {
    const float_rows_t rows = {a, lda, k};
    cb_rows_over_panels(fmt, m, k, wp, n, bias, c, ldc, float_rows_panel, &rows, m);
}
