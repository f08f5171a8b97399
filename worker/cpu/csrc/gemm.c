/* Linear layers for CPUs (float32 arithmetic): C[M, N] = A[M, K] @ W[N, K]^T (+ bias), with W packed once
 * at load time into one of the panel layouts of panels.h (float32, bfloat16-exact, or GGUF Q8_0 / Q4_1
 * blocks, each decoding to the checkpoint's float32 values).
 *
 * A work item is one 48-column panel and up to CB_ROW_BLOCK rows of A. It walks K in chunks of 64 or 256:
 * the chunk's weights are decoded once into an L1-sized float32 scratch (or read in place for float32
 * panels), then every row tile of the item multiplies it, keeping an mr x 48 block of C in vector
 * registers (mr <= CB_MR: 8 rows x 3 vectors with AVX-512, 4 rows without) between a per-thread
 * accumulator buffer and the next chunk.
 *
 * Why its own kernel and not oneDNN or MKL: a decode step multiplies every weight by only a few rows (one
 * per running request), so its cost is reading the weights from memory. This loop reads each panel exactly
 * once, in order, and the compact formats read 2x (bfloat16) to 5x (Q4_1) fewer bytes than float32 for the
 * same float32 arithmetic. benchmarks/bench_cpu.py prints the rates; BENCHMARKS.md has the runs.
 *
 * Each C element is one dot product summed in k order (from the bias, or zero) by one thread, so results
 * do not depend on the thread count, the chunking or the format the same values were packed in.
 */
#include "cb_simd.h"
#include "panels.h"

#ifdef __AVX512F__
#define CB_MR 8 /* 24 accumulators + 3 weight vectors of the 32 zmm registers */
#else
#define CB_MR 4 /* vf16 is two ymm registers here: 12 accumulators x 2 + 3 x 2 weight halves */
#endif
#define CB_ROW_BLOCK 192 /* rows one work item covers when M is large (3-6% faster than 96 at 512-1024) */
/* k values per chunk, multiples of CB_QK: 12 KB of decoded weights for few rows, 48 KB for many (measured
 * best for 1-22 and 64-1024 rows of SmolLM2's shapes) */
#define CB_KC_FEW 64
#define CB_KC_MANY 256
#define CB_MANY_ROWS 32

/* An mr x 48 block of C over one chunk of kn k values. acc_io: the block's partial sums ([mr][48]), read
 * unless first (then the start is bias or zero) and written unless c (then the result goes to c, ncols
 * columns a row). */
static inline __attribute__((always_inline)) void tile(const int mr, const float *restrict a, int64_t lda,
                                                       const float *restrict w, int kn, int first,
                                                       const float *bias, float *restrict acc_io,
                                                       float *restrict c, int64_t ldc, int ncols) {
    vf16 acc[CB_MR][3];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < 3; ++j)
            acc[i][j] = !first ? cb_load16(acc_io + i * CB_NR + 16 * j) : bias ? cb_load16(bias + 16 * j) : (vf16){0};
    for (int kk = 0; kk < kn; ++kk) {
        const float *wk = w + (int64_t)kk * CB_NR;
        const vf16 w0 = cb_load16(wk), w1 = cb_load16(wk + 16), w2 = cb_load16(wk + 32);
        for (int i = 0; i < mr; ++i) {
            const float x = a[i * lda + kk];
            acc[i][0] += x * w0;
            acc[i][1] += x * w1;
            acc[i][2] += x * w2;
        }
    }
    for (int i = 0; i < mr; ++i) {
        if (!c) {
            for (int j = 0; j < 3; ++j) cb_store16(acc_io + i * CB_NR + 16 * j, acc[i][j]);
        } else if (ncols == CB_NR) {
            for (int j = 0; j < 3; ++j) cb_store16(c + i * ldc + 16 * j, acc[i][j]);
        } else {
            float tmp[CB_NR];
            for (int j = 0; j < 3; ++j) cb_store16(tmp + 16 * j, acc[i][j]);
            memcpy(c + i * ldc, tmp, sizeof(float) * (size_t)ncols);
        }
    }
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

/* a: [m, k] rows lda floats apart; wp: W [n, k] packed in format fmt (panels.c); bias: [n] or NULL;
 * c: [m, n] rows ldc floats apart. */
int cb_linear(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n, const float *bias,
              float *c, int64_t ldc) {
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    if (m < 0 || n < 1 || pbytes < 0 || lda < k || ldc < n) return CB_EINVAL;
    if (m == 0) return CB_OK;
    const int panels = (n + CB_NR - 1) / CB_NR, row_blocks = (m + CB_ROW_BLOCK - 1) / CB_ROW_BLOCK;
#pragma omp parallel
    {
        float scratch[CB_KC_MANY * CB_NR] __attribute__((aligned(64)));
        float accbuf[CB_ROW_BLOCK * CB_NR] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int item = 0; item < panels * row_blocks; ++item) {
            const int p = item / row_blocks, r0 = (item % row_blocks) * CB_ROW_BLOCK;
            const int rows = m - r0 < CB_ROW_BLOCK ? m - r0 : CB_ROW_BLOCK;
            const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
            float tail_bias[CB_NR] = {0}; /* the last panel's bias, zero-padded: the tile reads 48 at a time */
            const float *b = bias ? bias + p * CB_NR : NULL;
            if (b && ncols < CB_NR) {
                memcpy(tail_bias, b, sizeof(float) * (size_t)ncols);
                b = tail_bias;
            }
            panel_rows(fmt, a + (int64_t)r0 * lda, lda, rows, k, wp + p * pbytes, b, c + (int64_t)r0 * ldc + p * CB_NR,
                       ldc, ncols, scratch, accbuf);
        }
    }
    return CB_OK;
}
