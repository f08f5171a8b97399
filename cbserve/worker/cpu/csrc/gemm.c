/* Linear layers for CPUs (float32 arithmetic): C[M, N] = A[M, K] @ W[N, K]^T (+ bias), with W packed once
 * at load time into one of the panel layouts of panels.h (float32, bfloat16-exact, or GGUF Q8_0 / Q4_1
 * blocks, each decoding to the checkpoint's float32 values).
 *
 * A work item is one 48-column panel and up to CB_ROW_BLOCK rows of A. It walks K in chunks of 64 or 256:
 * the chunk's weights are decoded once into an L1-sized float32 scratch (or read in place for float32
 * panels), then every row tile of the item multiplies it, keeping an mr x 48 block of C in vector
 * registers (mr <= CB_MR rows by the panel's 48 columns in groups sized for the ISA level's registers, see
 * below) between a per-thread accumulator buffer and the next chunk.
 *
 * Why its own kernel and not oneDNN or MKL: a decode step multiplies every weight by only a few rows (one
 * per running request), so its cost is reading the weights from memory. This loop reads each panel exactly
 * once, in order, and the compact formats read 2x (bfloat16) to 7x (Q4_0) fewer bytes than float32 for the
 * same float32 arithmetic. benchmarks/bench_cpu.py prints the rates; BENCHMARKS.md has the runs.
 *
 * A few rows (a decode step's, up to 4) go to rows.c instead, which decodes each weight vector in registers
 * for all of them at once: the same sums, without the scratch round trip.
 *
 * Each C element is one dot product summed in k order (from the bias, or zero) by one thread, so results
 * do not depend on the thread count, the chunking or the format the same values were packed in. The items
 * are shared out by cb_share_next (cb_simd.h): a thread's own contiguous share first, then what is left of
 * the others', so a thread preempted mid-product leaves its partner the rest of its share to do.
 */
#include <stdlib.h>

#include "cb_simd.h"
#include "panels.h"

/* Register blocking: a tile is mr rows (mr <= CB_MR) by nv vectors of CB_VW columns, nv * CB_VW dividing the
 * panel's 48; a panel is covered by 48 / (nv * CB_VW) column groups, one after the other, each keeping its
 * mr x nv accumulators in registers over the whole chunk. AVX-512 (32 zmm): 8 rows x 3 vectors, one group.
 * AVX2 (16 ymm): up to 2 rows x 6 vectors (one group: each weight vector loaded once for both rows), else 4
 * rows x 3 vectors in two groups of 24 columns (12 accumulators, 3 weights, a broadcast: the 16 registers).
 * Scalar (4 lanes, 16 registers): 4 rows x 3 vectors in four groups. */
#if CB_VW == 16
#define CB_MR 8
#define CB_NV(mr) 3
#elif CB_VW == 8
#define CB_MR 4
#define CB_NV(mr) ((mr) <= 2 ? 6 : 3)
#else
#define CB_MR 4
#define CB_NV(mr) 3
#endif
#define CB_MAX_NV (CB_NR / CB_VW < 6 ? CB_NR / CB_VW : 6)
#define CB_ROW_BLOCK 192 /* rows one work item covers when M is large (3-6% faster than 96 at 512-1024) */
/* k values per chunk, multiples of CB_QK: 12 KB of decoded weights for few rows, 48 KB for many with AVX-512
 * (measured best for 1-22 and 64-1024 rows of SmolLM2's shapes), 24 KB with fewer registers, where each chunk
 * is read once per column group (AVX2, 2-core Xeon: 121-125 GFLOP/s at 64-1024 rows against 95 with 48 KB) */
#define CB_KC_FEW 64
#if CB_VW == 16
#define CB_KC_MANY 256
#else
#define CB_KC_MANY 128
#endif
#define CB_MANY_ROWS 32
/* k pairs per chunk of bfloat16 weights multiplied in place (CB_FMT_BF16_DOT), for any row count: 96 KB, past
 * L1, but fewer accumulator round trips. Llama-3.2-1B's four shapes on a 2-core Zen 4, against 32 pairs: 16 rows
 * 7.84 -> 5.95 ms a layer, 32 rows 12.96 -> 10.02, 128 rows 41.6 -> 36.2; 1-8 rows (memory-bound) the same. */
#define CB_KC_BF16_PAIRS 512
/* rows from which bfloat16 products go to AMX tiles where there are some (amx.c) */
#define CB_AMX_MIN_ROWS 4

static int cb_linear_bf16_dot(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                              const float *bias, float *c, int64_t ldc);

/* Columns [col, col + nv * CB_VW) of an mr x 48 block of C over one chunk of kn k values. acc_io: the block's
 * partial sums ([mr][48]), read unless first (then the start is bias or zero) and written unless out (then
 * the result goes to out, rows ldo floats apart). */
static inline __attribute__((always_inline)) void tile_group(const int mr, const int nv, const float *restrict a,
                                                             int64_t lda, const float *restrict w, int kn,
                                                             int first, const float *bias, float *restrict acc_io,
                                                             float *restrict out, int64_t ldo, int col) {
    vf acc[CB_MR][CB_MAX_NV];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nv; ++j) {
            const int at = col + CB_VW * j;
            acc[i][j] = !first ? cb_load(acc_io + i * CB_NR + at) : bias ? cb_load(bias + at) : (vf){0};
        }
    for (int kk = 0; kk < kn; ++kk) {
        const float *wk = w + (int64_t)kk * CB_NR + col;
        vf wv[CB_MAX_NV];
        for (int j = 0; j < nv; ++j) wv[j] = cb_load(wk + CB_VW * j);
        for (int i = 0; i < mr; ++i) {
            const float x = a[i * lda + kk];
            for (int j = 0; j < nv; ++j) acc[i][j] += x * wv[j];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nv; ++j) {
            const int at = col + CB_VW * j;
            cb_store(out ? out + i * ldo + at : acc_io + i * CB_NR + at, acc[i][j]);
        }
}

/* An mr x 48 block of C over one chunk, group by group; out: c (ncols columns a row) when this is the last
 * chunk, else NULL (the partial sums stay in acc_io). */
static inline __attribute__((always_inline)) void tile(const int mr, const float *restrict a, int64_t lda,
                                                       const float *restrict w, int kn, int first,
                                                       const float *bias, float *restrict acc_io,
                                                       float *restrict c, int64_t ldc, int ncols) {
    const int nv = CB_NV(mr), gw = nv * CB_VW; /* constants once inlined */
    float tmp[CB_MR * CB_NR] __attribute__((aligned(64))); /* a partial last panel's rows, cut to ncols after */
    float *out = c && ncols < CB_NR ? tmp : c;
    const int64_t ldo = out == tmp ? CB_NR : ldc;
    for (int col = 0; col < CB_NR; col += gw) tile_group(mr, nv, a, lda, w, kn, first, bias, acc_io, out, ldo, col);
    if (out == tmp)
        for (int i = 0; i < mr; ++i) memcpy(c + i * ldc, tmp + i * CB_NR, sizeof(float) * (size_t)ncols);
}

/* mr as a compile-time constant in each case, so the accumulators stay in registers. */
static void tile_rows(int mr, const float *a, int64_t lda, const float *w, int kn, int first, const float *bias,
                      float *acc_io, float *c, int64_t ldc, int ncols) {
    switch (mr) {
#define CB_TILE_CASE(R)                                              \
    case R:                                                          \
        tile(R, a, lda, w, kn, first, bias, acc_io, c, ldc, ncols); \
        break;
        CB_TILE_CASE(1)
        CB_TILE_CASE(2)
        CB_TILE_CASE(3)
        CB_TILE_CASE(4)
#if CB_MR > 4
        CB_TILE_CASE(5)
        CB_TILE_CASE(6)
        CB_TILE_CASE(7)
        CB_TILE_CASE(8)
#endif
    }
}

/* Ask for the packed bytes that follow [begin, end) of a panel, as many again, into L2: the next chunk, or
 * the next panel's first (panels follow each other in memory, and a thread's items are consecutive). The
 * kernel reads a chunk in one burst and then computes for thousands of cycles without loads, so the
 * hardware prefetcher does not run ahead by itself: 12-14% faster at 12-22 rows (decoded formats). */
static inline void prefetch_next(const uint8_t *panel, int64_t begin, int64_t end) {
    for (int64_t off = end; off < 2 * end - begin; off += 64) __builtin_prefetch(panel + off, 0, 2);
}

/* One work item: rows [r0, r0 + rows) of A against one panel. */
static void panel_rows(int fmt, const float *a, int64_t lda, int rows, int k, const uint8_t *panel,
                       const float *bias, float *c, int64_t ldc, int ncols, float *scratch, float *accbuf) {
    /* rows split into tiles of near-equal height: 11 rows -> 6 + 5, not 8 + 3 */
    const int tiles = (rows + CB_MR - 1) / CB_MR, base = rows / tiles, extra = rows % tiles;
    const int kc = rows > CB_MANY_ROWS ? CB_KC_MANY : CB_KC_FEW;
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    for (int k0 = 0; k0 < k; k0 += kc) {
        const int kn = k - k0 < kc ? k - k0 : kc, first = k0 == 0, last = k0 + kn == k;
        const float *w = cb_panel_chunk(fmt, panel, k0, kn, scratch);
        if (fmt != CB_FMT_F32) /* float32 panels are read in place, a steady stream: 10% slower with it */
            prefetch_next(panel, pbytes * k0 / k, pbytes * (k0 + kn) / k); /* bytes grow with k in all formats */
        for (int t = 0, i = 0; t < tiles; ++t) {
            const int mr = base + (t < extra);
            tile_rows(mr, a + (int64_t)i * lda + k0, lda, w, kn, first, bias, accbuf + i * CB_NR,
                      last ? c + (int64_t)i * ldc : NULL, ldc, ncols);
            i += mr;
        }
    }
}

/* Every work item of C = A W^T: item = (panel, block of CB_ROW_BLOCK rows), spread over the threads. */
static void linear_items(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                         const float *bias, float *c, int64_t ldc) {
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    const int panels = (n + CB_NR - 1) / CB_NR, row_blocks = (m + CB_ROW_BLOCK - 1) / CB_ROW_BLOCK;
    cb_share_t shares[CB_MAX_SHARES];
    const int nshares = cb_shares_init(shares, panels * row_blocks);
#pragma omp parallel
    {
        float scratch[(CB_KC_MANY + 1) * CB_NR] __attribute__((aligned(64))); /* + the pad row of an odd k */
        float accbuf[CB_ROW_BLOCK * CB_NR] __attribute__((aligned(64)));
        for (int item; (item = cb_share_next(shares, nshares)) >= 0;) {
            const int p = item / row_blocks, r0 = (item % row_blocks) * CB_ROW_BLOCK;
            const int rows = m - r0 < CB_ROW_BLOCK ? m - r0 : CB_ROW_BLOCK;
            const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
            float tail_bias[CB_NR];
            const float *b = cb_item_bias(bias, p, ncols, tail_bias);
            panel_rows(fmt, a + (int64_t)r0 * lda, lda, rows, k, wp + p * pbytes, b, c + (int64_t)r0 * ldc + p * CB_NR,
                       ldc, ncols, scratch, accbuf);
        }
    }
}

int cb_isa_features(void) {
    int f = 0;
#if CB_VW == 8
    f |= CB_ISA_AVX2;
#elif CB_VW == 16
    f |= CB_ISA_AVX2 | CB_ISA_AVX512;
#endif
#ifdef __AVX512BF16__
    f |= CB_ISA_AVX512_BF16;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
    f |= CB_ISA_AMX;
#endif
#if CB_I16_DOT
    f |= CB_ISA_I16_DOT;
#endif
    return f;
}

/* a: [m, k] rows lda floats apart; wp: W [n, k] packed in format fmt (panels.c); bias: [n] or NULL;
 * c: [m, n] rows ldc floats apart. */
int cb_linear(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n, const float *bias,
              float *c, int64_t ldc) {
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    if (m < 0 || n < 1 || pbytes < 0 || lda < k || ldc < n) return CB_EINVAL;
    if (m == 0) return CB_OK;
    if (cb_bf16_products(fmt)) return cb_linear_bf16_dot(fmt, a, lda, m, k, wp, n, bias, c, ldc);
    if (cb_rows_i16_take(fmt, m, k)) return cb_linear_rows_i16(fmt, a, lda, m, k, wp, n, bias, c, ldc);
    if (cb_rows_take(fmt, m, k)) {
        cb_linear_rows(fmt, a, lda, m, k, wp, n, bias, c, ldc);
        return CB_OK;
    }
    linear_items(fmt, a, lda, m, k, wp, n, bias, c, ldc);
    return CB_OK;
}

/* ---- bfloat16 products (CB_FMT_BF16_DOT) ------------------------------------------------------------ */

#ifdef __AVX512BF16__
#include <immintrin.h>

/* As tile(), over kp k pairs: a holds each row's bfloat16 pairs (as uint32, lda pairs apart), w the panel's
 * [kp][48][2]; one vdpbf16ps adds both products of a pair to each of 16 columns. */
static inline __attribute__((always_inline)) void tile_dot(const int mr, const uint32_t *restrict a, int64_t lda,
                                                           const uint16_t *restrict w, int kp, int first,
                                                           const float *bias, float *restrict acc_io,
                                                           float *restrict c, int64_t ldc, int ncols) {
    __m512 acc[CB_MR][3];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < 3; ++j)
            acc[i][j] = !first ? _mm512_loadu_ps(acc_io + i * CB_NR + 16 * j)
                        : bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    for (int kk = 0; kk < kp; ++kk) {
        const uint16_t *wk = w + (int64_t)kk * 2 * CB_NR;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
        for (int i = 0; i < mr; ++i) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[i * lda + kk]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, w1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], x, w2);
        }
    }
    for (int i = 0; i < mr; ++i) {
        float *dst = c ? c + i * ldc : acc_io + i * CB_NR, tmp[CB_NR];
        float *out = c && ncols < CB_NR ? tmp : dst;
        for (int j = 0; j < 3; ++j) _mm512_storeu_ps(out + 16 * j, acc[i][j]);
        if (out == tmp) memcpy(dst, tmp, sizeof(float) * (size_t)ncols);
    }
}

static void tile_dot_rows(int mr, const uint32_t *a, int64_t lda, const uint16_t *w, int kp, int first,
                          const float *bias, float *acc_io, float *c, int64_t ldc, int ncols) {
    switch (mr) {
#define CB_DOT_CASE(R)                                                   \
    case R:                                                              \
        tile_dot(R, a, lda, w, kp, first, bias, acc_io, c, ldc, ncols); \
        break;
        CB_DOT_CASE(1)
        CB_DOT_CASE(2)
        CB_DOT_CASE(3)
        CB_DOT_CASE(4)
        CB_DOT_CASE(5)
        CB_DOT_CASE(6)
        CB_DOT_CASE(7)
        CB_DOT_CASE(8)
    }
}

/* One work item: rows of a (bfloat16 pairs, lda pairs apart) against one panel of kp pairs. */
static void panel_rows_dot(int fmt, const uint32_t *a, int64_t lda, int rows, int kp, const uint8_t *panel,
                           const float *bias, float *c, int64_t ldc, int ncols, uint16_t *pairs, float *accbuf) {
    const int tiles = (rows + CB_MR - 1) / CB_MR, base = rows / tiles, extra = rows % tiles;
    const int kc = fmt == CB_FMT_BF16_DOT ? CB_KC_BF16_PAIRS : (rows > CB_MANY_ROWS ? CB_KC_MANY : CB_KC_FEW) / 2;
    for (int k0 = 0; k0 < kp; k0 += kc) {
        const int kn = kp - k0 < kc ? kp - k0 : kc, first = k0 == 0, last = k0 + kn == kp;
        const uint16_t *w = cb_panel_pairs(fmt, panel, 2 * k0, 2 * kn, pairs);
        for (int t = 0, i = 0; t < tiles; ++t) {
            const int mr = base + (t < extra);
            tile_dot_rows(mr, a + (int64_t)i * lda + k0, lda, w, kn, first, bias, accbuf + i * CB_NR,
                          last ? c + (int64_t)i * ldc : NULL, ldc, ncols);
            i += mr;
        }
    }
}

/* a row of k floats -> bfloat16 pairs (2 kp values, a zero padding an odd k) */
static void row_to_bf16(const float *restrict x, int k, int kp, uint16_t *restrict out) {
    int kk = 0;
    for (; kk + 32 <= k; kk += 32)
        _mm512_storeu_si512(out + kk, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + kk + 16), _mm512_loadu_ps(x + kk)));
    for (; kk < 2 * kp; ++kk) out[kk] = kk < k ? cb_bf16_bits(x[kk]) : 0;
}

/* One row (a decode step's) against GGUF block panels under bfloat16 products: each panel's weights decoded
 * straight into the sums (cb_blocks_row_dot: 1.1-1.2x the tiled path at decode shapes, same bits), and each
 * thread rounds the row itself (a few hundred cycles) instead of waiting at a barrier for one thread to do it
 * into an allocated buffer. The panel loop needs no barrier of its own: the region's end is one. */
static void blocks_one_row(int fmt, const float *a, int k, const uint8_t *wp, int64_t pbytes, int n,
                           const float *bias, float *c) {
    const int kp = (k + 1) / 2, panels = (n + CB_NR - 1) / CB_NR;
    cb_share_t shares[CB_MAX_SHARES];
    const int nshares = cb_shares_init(shares, panels);
#pragma omp parallel
    {
        uint32_t row[kp];
        float acc[CB_NR] __attribute__((aligned(64)));
        row_to_bf16(a, k, kp, (uint16_t *)row);
        for (int p; (p = cb_share_next(shares, nshares)) >= 0;) {
            const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
            float tail_bias[CB_NR];
            const float *b = cb_item_bias(bias, p, ncols, tail_bias);
            for (int j = 0; j < CB_NR; ++j) acc[j] = b ? b[j] : 0.0f;
            cb_blocks_row_dot(fmt, row, kp, wp + p * pbytes, acc);
            memcpy(c + p * CB_NR, acc, sizeof(float) * (size_t)ncols);
        }
    }
}

/* A's rows rounded to bfloat16 pairs in 16 x 16-pair tiles (zero rows up to a multiple of 16), then AMX (amx.c). */
static int linear_amx(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                      const float *bias, float *c, int64_t ldc) {
    const int kp = (k + 1) / 2, mpad = (m + 15) / 16 * 16;
    uint32_t *ab = malloc(sizeof(uint32_t) * (size_t)((int64_t)mpad * kp));
    if (!ab) return CB_ENOMEM;
    const int kt = kp / 16; /* tiles of 16 rows x 16 pairs, each 1 KB contiguous: [row / 16][pair / 16][16][16] */
    for (int i = m; i < mpad; ++i)
        for (int t = 0; t < kt; ++t) memset(ab + ((int64_t)(i / 16) * kt + t) * 256 + (i % 16) * 16, 0, 64);
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; ++i) {
        uint32_t row[kp];
        row_to_bf16(a + (int64_t)i * lda, k, kp, (uint16_t *)row);
        for (int t = 0; t < kt; ++t) memcpy(ab + ((int64_t)(i / 16) * kt + t) * 256 + (i % 16) * 16, row + 16 * t, 64);
    }
    const int rc = cb_linear_amx(fmt, ab, kp, m, wp, cb_panel_bytes(fmt, k), n, bias, c, ldc);
    free(ab);
    return rc;
}

/* A's rows rounded to bfloat16 pairs, then every work item as linear_items does. */
static int cb_linear_bf16_dot(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                              const float *bias, float *c, int64_t ldc) {
    const int kp = (k + 1) / 2, panels = (n + CB_NR - 1) / CB_NR, row_blocks = (m + CB_ROW_BLOCK - 1) / CB_ROW_BLOCK;
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    if (m == 1 && cb_bf16_blocks(fmt)) {
        blocks_one_row(fmt, a, k, wp, pbytes, n, bias, c);
        return CB_OK;
    }
    if (m >= CB_AMX_MIN_ROWS && kp % 16 == 0 && cb_amx_ready()) return linear_amx(fmt, a, lda, m, k, wp, n, bias, c, ldc);
    uint32_t *ab = malloc(sizeof(uint32_t) * (size_t)((int64_t)m * kp));
    if (!ab) return CB_ENOMEM;
    cb_share_t shares[CB_MAX_SHARES];
    const int nshares = cb_shares_init(shares, panels * row_blocks);
#pragma omp parallel
    {
        float accbuf[CB_ROW_BLOCK * CB_NR] __attribute__((aligned(64)));
        uint16_t pairs[CB_KC_MANY * CB_NR] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int i = 0; i < m; ++i) row_to_bf16(a + (int64_t)i * lda, k, kp, (uint16_t *)(ab + (int64_t)i * kp));
        for (int item; (item = cb_share_next(shares, nshares)) >= 0;) {
            const int p = item / row_blocks, r0 = (item % row_blocks) * CB_ROW_BLOCK;
            const int rows = m - r0 < CB_ROW_BLOCK ? m - r0 : CB_ROW_BLOCK;
            const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
            float tail_bias[CB_NR];
            panel_rows_dot(fmt, ab + (int64_t)r0 * kp, kp, rows, kp, wp + p * pbytes,
                           cb_item_bias(bias, p, ncols, tail_bias), c + (int64_t)r0 * ldc + p * CB_NR, ldc, ncols,
                           pairs, accbuf);
        }
    }
    free(ab);
    return CB_OK;
}

#else /* no AVX-512 BF16: the same products in float32 FMAs, from A rounded to bfloat16 */

static int cb_linear_bf16_dot(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                              const float *bias, float *c, int64_t ldc) {
    float *ar = malloc(sizeof(float) * (size_t)((int64_t)m * k));
    if (!ar) return CB_ENOMEM;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < m; ++i)
        for (int kk = 0; kk < k; ++kk) ar[(int64_t)i * k + kk] = cb_round_bf16(a[(int64_t)i * lda + kk]);
    linear_items(fmt, ar, k, m, k, wp, n, bias, c, ldc); /* cb_panel_chunk rounds the decoded weights */
    free(ar);
    return CB_OK;
}
#endif
