/* Linear layers for CPUs (float32): C[M, N] = A[M, K] @ W[N, K]^T (+ bias), with W packed once at load time.
 *
 * Packed layout: W is cut into panels of CB_NR = 48 output columns; panel p holds, for k = 0..K-1, the 48
 * weights W[48p .. 48p+47, k] next to each other ([N/48][K][48], the last panel zero-padded). A micro-kernel
 * keeps an mr x 48 block of C in vector registers (mr <= CB_MR: 8 rows x 3 vectors with AVX-512, 4 rows
 * without) and, for every k, multiplies three weight vectors by mr broadcast values of A.
 *
 * Why not oneDNN or MKL: a decode step multiplies every weight by only a few rows (one per running
 * request). Then the cost is reading the weights from memory, and this loop reads each panel exactly once
 * from DRAM for the first row tile, in order, while the later row tiles of the same panel hit L2. Measured
 * on a 2-core AMD EPYC (Zen 4) for all of SmolLM2-135M's weights: 1.2-1.8x oneDNN's packed kernels for 1 to
 * 64 rows, 1.03-1.3x for 512-1024 rows; slower than oneDNN for large square products (0.82x at 2048^3),
 * which have no K blocking here (benchmarks/bench_cpu.py prints the rates).
 *
 * Threads split the panels (and, for many rows, blocks of rows); each C element is one dot product
 * summed in k order by one thread, so results do not depend on the thread count.
 */
#include "cb_cpu.h"

#define CB_NR 48
#ifdef __AVX512F__
#define CB_MR 8 /* 24 accumulators + 3 weight vectors of the 32 zmm registers */
#else
#define CB_MR 4 /* vf16 is two ymm registers here: 12 accumulators x 2 + 3 x 2 weight halves */
#endif
#define CB_ROW_BLOCK 96 /* rows one work item covers when M is large */

int cb_gemm_panel_width(void) { return CB_NR; }

int64_t cb_packed_size(int n, int k) { return (int64_t)((n + CB_NR - 1) / CB_NR) * k * CB_NR; }

/* w: [n, k] rows ldw floats apart -> out: cb_packed_size(n, k) floats. */
int cb_pack_weight_f32(const float *w, int64_t ldw, int n, int k, float *out) {
    if (n < 1 || k < 1 || ldw < k) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        float *dst = out + (int64_t)p * k * CB_NR;
        for (int kk = 0; kk < k; ++kk)
            for (int j = 0; j < CB_NR; ++j) {
                const int row = p * CB_NR + j;
                dst[(int64_t)kk * CB_NR + j] = row < n ? w[(int64_t)row * ldw + kk] : 0.0f;
            }
    }
    return CB_OK;
}

/* One mr x 48 block of C over the whole of K; ncols < 48 only in the last panel. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *restrict a, int64_t lda,
                                                       const float *restrict w, int k, const float *bias,
                                                       float *restrict c, int64_t ldc, int ncols) {
    vf16 acc[CB_MR][3];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < 3; ++j) acc[i][j] = bias ? cb_load16(bias + 16 * j) : (vf16){0};
    for (int kk = 0; kk < k; ++kk) {
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
        if (ncols == CB_NR) {
            for (int j = 0; j < 3; ++j) cb_store16(c + i * ldc + 16 * j, acc[i][j]);
        } else {
            float tmp[CB_NR];
            for (int j = 0; j < 3; ++j) cb_store16(tmp + 16 * j, acc[i][j]);
            memcpy(c + i * ldc, tmp, sizeof(float) * (size_t)ncols);
        }
    }
}

/* mr as a compile-time constant in each case, so the accumulators stay in registers. */
static void tile_rows(int mr, const float *a, int64_t lda, const float *w, int k, const float *bias, float *c,
                      int64_t ldc, int ncols) {
    switch (mr) {
#define CB_TILE_CASE(R)                                  \
    case R:                                              \
        tile(R, a, lda, w, k, bias, c, ldc, ncols);      \
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

/* a: [m, k] rows lda floats apart; wp: cb_pack_weight_f32(W[n, k]); bias: [n] or NULL; c: [m, n] rows ldc
 * floats apart. */
int cb_linear_f32(const float *a, int64_t lda, int m, int k, const float *wp, int n, const float *bias, float *c,
                  int64_t ldc) {
    if (m < 0 || n < 1 || k < 1 || lda < k || ldc < n) return CB_EINVAL;
    if (m == 0) return CB_OK;
    const int panels = (n + CB_NR - 1) / CB_NR, row_blocks = (m + CB_ROW_BLOCK - 1) / CB_ROW_BLOCK;
#pragma omp parallel for schedule(static)
    for (int item = 0; item < panels * row_blocks; ++item) {
        const int p = item / row_blocks, r0 = (item % row_blocks) * CB_ROW_BLOCK;
        const int rows = m - r0 < CB_ROW_BLOCK ? m - r0 : CB_ROW_BLOCK;
        const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
        const float *w = wp + (int64_t)p * k * CB_NR;
        float tail_bias[CB_NR] = {0}; /* the last panel's bias, zero-padded: the tile reads 48 at a time */
        const float *b = bias ? bias + p * CB_NR : NULL;
        if (b && ncols < CB_NR) {
            memcpy(tail_bias, b, sizeof(float) * (size_t)ncols);
            b = tail_bias;
        }
        /* rows split into tiles of near-equal height: 11 rows -> 6 + 5, not 8 + 3 */
        const int tiles = (rows + CB_MR - 1) / CB_MR, base = rows / tiles, extra = rows % tiles;
        for (int t = 0, i = r0; t < tiles; ++t) {
            const int mr = base + (t < extra);
            tile_rows(mr, a + (int64_t)i * lda, lda, w, k, b, c + (int64_t)i * ldc + p * CB_NR, ldc, ncols);
            i += mr;
        }
    }
    return CB_OK;
}
