/* Multi-LoRA for CPUs: every adapter's product of one linear layer for a whole mixed batch in one call, the
 * batch's rows grouped by adapter into segments (Punica's SGMV, S-LoRA). For each segment, a shrink t = x A^T
 * (dot products along `in`, a tile of rows against a tile of A's rows, so that each A row loaded serves several
 * x rows and each x row several A rows) then an expand y += t B^T (B stored transposed: axpys along `out`, a
 * tile of rows by a few vectors of y kept in registers while the adapter's columns go by).
 *
 * A work item is one segment's block of up to CB_LORA_RB rows, so 16 decode segments of a few rows and one
 * prefill segment of 2000 rows both spread over every thread; the items are shared out by cb_share_next
 * (cb_simd.h). Each y element is summed by one thread in a fixed order (its old value, then the adapter's
 * columns in order), so results do not depend on the thread count.
 *
 * A slot holds up to CB_LORA_MAX_COLS columns (rank 512 of a fused q/k/v projection: 3 x 512). An item takes
 * them CB_LORA_CHUNK at a time (shrink the chunk's columns, add their expand into y, next chunk: rows_in_chunks),
 * so its scratch t is CB_LORA_RB x CB_LORA_CHUNK floats (32 KB on an OpenMP thread's stack, whatever the rank)
 * and each y element still gets its old value, then the columns in order.
 *
 * Two element types for the adapters, one body. cb_lora_add_f32: float32 A and Bt, float32 products.
 * cb_lora_add_bf16: the bfloat16 products of dtype="bfloat16" on these kernels (as the base layers'
 * CB_FMT_BF16_DOT): A and Bt stored as bfloat16 (half the memory) and widened as they are loaded (a 16-bit
 * shift), x rounded to bfloat16 as it is loaded, the shrink's t rounded to bfloat16 before the expand (as PEFT
 * in bfloat16 rounds x A^T); float32 sums into the float32 y. The functions below take the type as `bf16`, a
 * constant in each of the two instantiations (lora_rows_f32, lora_rows_bf16) that they are all inlined into.
 */
#include <stdlib.h>

#include "cb_simd.h"

#if CB_VW >= 8
#include <immintrin.h>
#endif

#define CB_LORA_MAX_COLS 1536 /* the most columns (rank x fused parts) a slot may hold: 3 x rank 512 */
#define CB_LORA_CHUNK 512     /* columns an item shrinks and expands at a time: t's scratch per item */
#define CB_LORA_RB 16         /* rows per work item (fewer when the batch is small, see rows_per_item) */
#define CB_LORA_MR 4          /* rows per register tile */
/* Register tiles: the shrink keeps MR x NC accumulators (one per (row, A row)), the expand MR x NV vectors
 * of y. AVX-512 (32 zmm): 4 x 4 and 4 x 6 (96 columns of y). AVX2 and the portable path (16 registers):
 * 4 x 2 and 4 x 3, leaving registers for the loads and the broadcast. */
#if CB_VW == 16
#define CB_LORA_NC 4
#define CB_LORA_NV 6
#else
#define CB_LORA_NC 2
#define CB_LORA_NV 3
#endif
#define CB_LORA_KC 8 /* adapter columns per pass over y when an item has few rows (see expand_all) */
#define CB_LORA_PARALLEL_MIN (1 << 20) /* flops below which one thread does the whole call */

#define CB_INLINE static inline __attribute__((always_inline))

typedef uint32_t vu __attribute__((vector_size(CB_VW * 4), aligned(4)));

/* CB_VW bfloat16 values (their bits) as float32: each shifted into the upper half of its lane. */
CB_INLINE vf widen_bf16(const uint16_t *p) {
#if CB_VW == 16
    const vu w = (vu)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif CB_VW == 8
    const vu w = (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else /* GCC's widening of a 16-bit vector (an element-wise loop would be scalar code) */
    typedef uint16_t vh __attribute__((vector_size(CB_VW * 2), aligned(2)));
    vh h;
    memcpy(&h, p, sizeof h);
    const vu w = __builtin_convertvector(h, vu);
#endif
    return (vf)(w << 16);
}

/* Each lane rounded to the nearest bfloat16 (ties to even), as cb_round_bf16. */
CB_INLINE vf round_lanes(vf v) {
    const vu b = (vu)v;
    return (vf)((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

/* The adapters' weights w (float32, or bfloat16 bits with bf16) at element i: a vector, one value, an address. */
CB_INLINE vf load_w(const void *w, int64_t i, const int bf16) {
    return bf16 ? widen_bf16((const uint16_t *)w + i) : cb_load((const float *)w + i);
}
CB_INLINE float scalar_w(const void *w, int64_t i, const int bf16) {
    if (!bf16) return ((const float *)w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
CB_INLINE const void *w_at(const void *w, int64_t i, const int bf16) { return (const char *)w + i * (bf16 ? 2 : 4); }
/* x (and t) as the products take them: rounded to bfloat16 with bf16. */
CB_INLINE vf load_x(const float *x, const int bf16) { return bf16 ? round_lanes(cb_load(x)) : cb_load(x); }
CB_INLINE float scalar_x(float v, const int bf16) { return bf16 ? cb_round_bf16(v) : v; }

/* t[i * ldt + j] = x_i . a_j for mr rows of x (ldx apart) and nc rows of a (in values each, contiguous). */
CB_INLINE void shrink_tile(const int mr, const int nc, const float *restrict x, int64_t ldx, const void *restrict a,
                           int in, float *restrict t, int ldt, const int bf16) {
    vf acc[CB_LORA_MR][CB_LORA_NC];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nc; ++j) acc[i][j] = (vf){0};
    int k = 0;
    for (; k + CB_VW <= in; k += CB_VW) {
        vf av[CB_LORA_NC];
        for (int j = 0; j < nc; ++j) av[j] = load_w(a, (int64_t)j * in + k, bf16);
        for (int i = 0; i < mr; ++i) {
            const vf xv = load_x(x + i * ldx + k, bf16);
            for (int j = 0; j < nc; ++j) acc[i][j] += xv * av[j];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nc; ++j) {
            float s = 0.0f;
            for (int l = 0; l < CB_VW; ++l) s += acc[i][j][l];
            for (int kk = k; kk < in; ++kk)
                s += scalar_x(x[i * ldx + kk], bf16) * scalar_w(a, (int64_t)j * in + kk, bf16);
            t[i * ldt + j] = scalar_x(s, bf16);
        }
}

/* y_i[0 : nv * CB_VW] += sum over c < cols of t[i * ldt + c] * bt_c, for mr rows (bt: rows `out` apart). */
CB_INLINE void expand_tile(const int mr, const int nv, const float *restrict t, int ldt, int cols,
                           const void *restrict bt, int out, float *restrict y, int64_t ldy, const int bf16) {
    vf acc[CB_LORA_MR][CB_LORA_NV];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nv; ++j) acc[i][j] = cb_load(y + i * ldy + CB_VW * j);
    for (int c = 0; c < cols; ++c) {
        vf bv[CB_LORA_NV];
        for (int j = 0; j < nv; ++j) bv[j] = load_w(bt, (int64_t)c * out + CB_VW * j, bf16);
        for (int i = 0; i < mr; ++i) {
            const float s = t[i * ldt + c];
            for (int j = 0; j < nv; ++j) acc[i][j] += s * bv[j];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nv; ++j) cb_store(y + i * ldy + CB_VW * j, acc[i][j]);
}

/* mr (and nc) as compile-time constants in each case, so the accumulators stay in registers. */
#define CB_LORA_CASES(CASE) CASE(1) CASE(2) CASE(3) CASE(4)

CB_INLINE void shrink_rows(int mr, int nc, const float *x, int64_t ldx, const void *a, int in, float *t, int ldt,
                           const int bf16) {
#define CB_SHRINK_CASE(R)                                                                  \
    case R:                                                                                \
        if (nc == CB_LORA_NC)                                                              \
            shrink_tile(R, CB_LORA_NC, x, ldx, a, in, t, ldt, bf16);                       \
        else                                                                               \
            for (int j = 0; j < nc; ++j)                                                   \
                shrink_tile(R, 1, x, ldx, w_at(a, (int64_t)j * in, bf16), in, t + j, ldt, bf16); \
        break;
    switch (mr) { CB_LORA_CASES(CB_SHRINK_CASE) }
#undef CB_SHRINK_CASE
}

CB_INLINE void expand_rows(int mr, int nv, const float *t, int ldt, int cols, const void *bt, int out, float *y,
                           int64_t ldy, const int bf16) {
#define CB_EXPAND_CASE(R)                                                   \
    case R:                                                                 \
        if (nv == CB_LORA_NV)                                               \
            expand_tile(R, CB_LORA_NV, t, ldt, cols, bt, out, y, ldy, bf16); \
        else                                                                \
            expand_tile(R, 1, t, ldt, cols, bt, out, y, ldy, bf16);         \
        break;
    switch (mr) { CB_LORA_CASES(CB_EXPAND_CASE) }
#undef CB_EXPAND_CASE
}

/* y += t Bt for nr rows: y's columns in tiles of CB_LORA_NV vectors, the rows inner (a tile of Bt serves every
 * row), the adapter's columns kc at a time. With few rows this is bound by reading Bt from memory: kc =
 * CB_LORA_KC reads it as that many sequential streams, which the hardware prefetcher follows, where a tile
 * over all the columns would be one short strided read per column. Splitting the columns changes no result
 * (each y element still gets its products added in column order). */
CB_INLINE void expand_all(const float *t, int nr, int cols, const void *bt, int out, float *y, int64_t ldy,
                          const int bf16) {
    const int kc = nr <= CB_LORA_MR ? CB_LORA_KC : cols, vec_end = out - out % CB_VW;
    for (int c0 = 0; c0 < cols; c0 += kc) {
        const int cn = cols - c0 < kc ? cols - c0 : kc;
        for (int col = 0; col < vec_end;) {
            const int nv = out - col >= CB_LORA_NV * CB_VW ? CB_LORA_NV : 1;
            for (int i = 0; i < nr; i += CB_LORA_MR)
                expand_rows(nr - i < CB_LORA_MR ? nr - i : CB_LORA_MR, nv, t + i * cols + c0, cols, cn,
                            w_at(bt, (int64_t)c0 * out + col, bf16), out, y + i * ldy + col, ldy, bf16);
            col += nv * CB_VW;
        }
    }
    for (int i = 0; i < nr; ++i) /* the last out % CB_VW columns */
        for (int o = vec_end; o < out; ++o) {
            float s = y[i * ldy + o];
            for (int c = 0; c < cols; ++c) s += t[i * cols + c] * scalar_w(bt, (int64_t)c * out + o, bf16);
            y[i * ldy + o] = s;
        }
}

/* One work item of at most CB_LORA_CHUNK columns: rows of one segment, t = x A^T then y += t Bt. The shrink walks
 * rows in tiles with A's rows inner (a tile of x stays in L1 while A streams by). */
CB_INLINE void lora_rows(const float *x, int64_t ldx, float *y, int64_t ldy, int nr, int in, int out, const void *a,
                         const void *bt, int cols, const int bf16) {
    float t[CB_LORA_RB * CB_LORA_CHUNK] __attribute__((aligned(64)));
    for (int i = 0; i < nr; i += CB_LORA_MR) {
        const int mr = nr - i < CB_LORA_MR ? nr - i : CB_LORA_MR;
        for (int c = 0; c < cols; c += CB_LORA_NC)
            shrink_rows(mr, cols - c < CB_LORA_NC ? cols - c : CB_LORA_NC, x + i * ldx, ldx,
                        w_at(a, (int64_t)c * in, bf16), in, t + i * cols + c, cols, bf16);
    }
    expand_all(t, nr, cols, bt, out, y, ldy, bf16);
}

typedef void (*rows_fn)(const float *, int64_t, float *, int64_t, int, int, int, const void *, const void *, int);

static void lora_rows_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int nr, int in, int out, const void *a,
                          const void *bt, int cols) {
    lora_rows(x, ldx, y, ldy, nr, in, out, a, bt, cols, 0);
}

static void lora_rows_bf16(const float *x, int64_t ldx, float *y, int64_t ldy, int nr, int in, int out,
                           const void *a, const void *bt, int cols) {
    lora_rows(x, ldx, y, ldy, nr, in, out, a, bt, cols, 1);
}

/* A work item of more columns than CB_LORA_CHUNK (a fused projection's adapter of rank over 170): its columns a
 * chunk at a time, each chunk an item of its own (shrunk, then its expand added into y), so each y element still
 * gets its old value, then the columns in order. Items of one chunk call `rows` straight: their code is the same
 * as before slots took more than one chunk. */
static void rows_in_chunks(const rows_fn rows, const float *x, int64_t ldx, float *y, int64_t ldy, int nr, int in,
                           int out, const void *a, const void *bt, int cols, const int bf16) {
    for (int c0 = 0; c0 < cols; c0 += CB_LORA_CHUNK)
        rows(x, ldx, y, ldy, nr, in, out, w_at(a, (int64_t)c0 * in, bf16), w_at(bt, (int64_t)c0 * out, bf16),
             cols - c0 < CB_LORA_CHUNK ? cols - c0 : CB_LORA_CHUNK);
}

typedef struct {
    int32_t start, end;
} cb_span_t;

static int span_order(const void *p, const void *q) {
    const cb_span_t *a = p, *b = q;
    return (a->start > b->start) - (a->start < b->start);
}

/* CB_ERANGE unless every segment has start, rows, slot >= 0 and cols in [0, cmax], and the segments with rows
 * are disjoint (their items write y in parallel); CB_ENOMEM if the check's buffer cannot be had. */
static int check_segments(const int32_t *seg, int nseg, int cmax) {
    cb_span_t *spans = malloc(sizeof(cb_span_t) * (size_t)nseg);
    if (!spans) return CB_ENOMEM;
    int n = 0, rc = CB_OK;
    for (int s = 0; s < nseg && rc == CB_OK; ++s) {
        const int32_t *g = seg + 4 * s;
        if (g[0] < 0 || g[1] < 0 || g[2] < 0 || g[3] < 0 || g[3] > cmax || (int64_t)g[0] + g[1] > INT32_MAX)
            rc = CB_ERANGE;
        else if (g[1] > 0)
            spans[n++] = (cb_span_t){g[0], g[0] + g[1]};
    }
    if (rc == CB_OK) {
        qsort(spans, (size_t)n, sizeof(cb_span_t), span_order);
        for (int s = 1; s < n && rc == CB_OK; ++s)
            if (spans[s].start < spans[s - 1].end) rc = CB_ERANGE;
    }
    free(spans);
    return rc;
}

/* Rows per item: CB_LORA_RB, halved down to CB_LORA_MR while there are fewer than two items a thread. */
static int rows_per_item(const int32_t *seg, int nseg, int threads) {
    int rb = CB_LORA_RB;
    for (; rb > CB_LORA_MR; rb /= 2) {
        int64_t items = 0;
        for (int s = 0; s < nseg; ++s)
            if (seg[4 * s + 3] > 0) items += (seg[4 * s + 1] + rb - 1) / rb;
        if (items >= 2 * (int64_t)threads) break;
    }
    return rb;
}

/* Both entry points: a and bt hold float32 values or, with bf16, bfloat16 bits. */
static int lora_add(const float *x, int64_t ldx, float *y, int64_t ldy, int in, int out, const void *a,
                    const void *bt, int cmax, const int32_t *seg, int nseg, const int bf16) {
    if (in < 1 || out < 1 || cmax < 1 || cmax > CB_LORA_MAX_COLS || ldx < in || ldy < out || nseg < 0)
        return CB_EINVAL;
    if (nseg == 0) return CB_OK;
    const int rc = check_segments(seg, nseg, cmax);
    if (rc != CB_OK) return rc;
    const int rb = rows_per_item(seg, nseg, cb_max_threads());
    int *first = malloc(sizeof(int) * (size_t)(nseg + 1)); /* items of segment s: [first[s], first[s + 1]) */
    if (!first) return CB_ENOMEM;
    int64_t items = 0, flops = 0;
    for (int s = 0; s < nseg; ++s) {
        const int32_t *g = seg + 4 * s;
        first[s] = (int)items;
        if (g[3] > 0) items += (g[1] + rb - 1) / rb;
        flops += g[3] > 0 ? 2 * (int64_t)g[1] * g[3] * (in + out) : 0;
    }
    first[nseg] = (int)items;
    if (items > INT32_MAX) {
        free(first);
        return CB_EINVAL;
    }
    const rows_fn rows = bf16 ? lora_rows_bf16 : lora_rows_f32;
    cb_share_t shares[CB_MAX_SHARES];
    const int nshares = cb_shares_init(shares, (int)items);
#pragma omp parallel if (items > 1 && flops >= CB_LORA_PARALLEL_MIN)
    {
        int s = 0; /* a thread's items mostly come in order: search on from its last segment */
        for (int item; (item = cb_share_next(shares, nshares)) >= 0;) {
            if (item < first[s]) s = 0;
            while (item >= first[s + 1]) ++s;
            const int32_t *g = seg + 4 * s;
            const int done = (item - first[s]) * rb, r0 = g[0] + done, nr = g[1] - done < rb ? g[1] - done : rb;
            const void *as = w_at(a, (int64_t)g[2] * cmax * in, bf16), *bs = w_at(bt, (int64_t)g[2] * cmax * out, bf16);
            if (g[3] <= CB_LORA_CHUNK)
                rows(x + (int64_t)r0 * ldx, ldx, y + (int64_t)r0 * ldy, ldy, nr, in, out, as, bs, g[3]);
            else
                rows_in_chunks(rows, x + (int64_t)r0 * ldx, ldx, y + (int64_t)r0 * ldy, ldy, nr, in, out, as, bs, g[3],
                               bf16);
        }
    }
    free(first);
    return CB_OK;
}

int cb_lora_add_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int in, int out, const float *a,
                    const float *bt, int cmax, const int32_t *seg, int nseg) {
    return lora_add(x, ldx, y, ldy, in, out, a, bt, cmax, seg, nseg, 0);
}

int cb_lora_add_bf16(const float *x, int64_t ldx, float *y, int64_t ldy, int in, int out, const uint16_t *a,
                     const uint16_t *bt, int cmax, const int32_t *seg, int nseg) {
    return lora_add(x, ldx, y, ldy, in, out, a, bt, cmax, seg, nseg, 1);
}
