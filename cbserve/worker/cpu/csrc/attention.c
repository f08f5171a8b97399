/* Paged decode attention for CPUs (float32): one query token per sequence, keys and values read in place
 * from the paged KV cache. Built and loaded by ../native.py.
 *
 * Layouts (all contiguous unless a stride is given):
 *   q            [num_seqs, num_heads, head_dim], rows q_row_stride floats apart
 *   out          [num_seqs, num_heads, head_dim], rows out_row_stride floats apart
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, bt_stride] int32;  seq_lens [num_seqs] int32 (>= 1)
 *
 * A sliding window (window > 0) limits each row to its last `window` keys; softcap > 0 caps the scores
 * (softcap * tanh(s / softcap), Gemma 2) before the softmax. 0 turns either off.
 *
 * Rows are spread over OpenMP threads (the same libgomp torch uses, so the same thread pool). Consecutive rows
 * of one sequence (the same block table, context lengths len, len + 1, ...: a prefill chunk, or a speculative
 * verification's 1 + k tokens) are attended together, up to CB_ROW_RUN at a time, as if they were more query
 * heads of one row: each cache block is read once for all of them, and a row's keys past its own length get
 * probability 0, which leaves every row's result bit for bit what it is alone. Per row (or run): scores of
 * every head against every cached token, block by block; a softmax per head; then the probability-weighted
 * sum of the values, block by block. For head_dim 64 and 128 (vectorised paths, blocked for the level's
 * vector width and register file: see CB_SEQ_KERNELS) each cache block is read once per pass as one
 * contiguous run of memory (all kv heads of its tokens); other head sizes go head by head.
 */
#include <math.h>
#include <stdlib.h>

#include "cb_simd.h"

typedef struct {
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t tok, blk; /* floats between consecutive tokens of a block, and between blocks */
    float scale;
    int window;    /* > 0: attend to the last `window` keys only */
    float softcap; /* > 0: scores -> softcap * tanh(score / softcap) before the softmax */
    int64_t ld;    /* floats between two heads' rows of scores (set per run by decode_run) */
} geom_t;

/* Any head_dim: sc[t] = scale * (q . k_t) for the keys of kv head kvh, t < len. */
static void qk_head_any(const float *restrict q, const float *restrict k_cache, const int32_t *restrict bt, int len,
                        const geom_t *geo, int kvh, float *restrict sc) {
    const int d = geo->head_dim, bs = geo->block_size;
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const int n = len - t0 < bs ? len - t0 : bs;
        const float *kb = k_cache + (int64_t)bt[b] * geo->blk + (int64_t)kvh * d;
        for (int j = 0; j < n; ++j) {
            const float *restrict kp = kb + j * geo->tok;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < d; ++i) acc += q[i] * kp[i];
            sc[t0 + j] = acc * geo->scale;
        }
    }
}

/* Any head_dim: o = sum_t p[t] * v_t over the values of kv head kvh. */
static void pv_head_any(const float *restrict p, const float *restrict v_cache, const int32_t *restrict bt, int len,
                        const geom_t *geo, int kvh, float *restrict o) {
    const int d = geo->head_dim, bs = geo->block_size;
    memset(o, 0, sizeof(float) * (size_t)d);
    for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {
        const int n = len - t0 < bs ? len - t0 : bs;
        const float *vb = v_cache + (int64_t)bt[b] * geo->blk + (int64_t)kvh * d;
        for (int j = 0; j < n; ++j) {
            const float *restrict vp = vb + j * geo->tok;
            const float w = p[t0 + j];
#pragma omp simd
            for (int i = 0; i < d; ++i) o[i] += w * vp[i];
        }
    }
}

/* Lane t of the result = the sum of the CB_VW lanes of a[t]: a transpose-and-add tree, CB_VW - 1 adds for
 * CB_VW sums instead of a horizontal sum each. Each level adds two shuffles of every pair of vectors: half as
 * many vectors, each lane still holding partial sums of one a[t]. The 8-wide tree shuffles within 128-bit
 * halves first and crosses them last (one AVX2 instruction a shuffle). */
#if CB_VW == 16
static inline vf reduce_vw(const vf *a) {
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                       31);
    for (int i = 0; i < 4; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif CB_VW == 8
static inline vf reduce_vw(const vf *a) {
    vf b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    for (int i = 0; i < 2; ++i)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#else
static inline vf reduce_vw(const vf *a) {
    vf b[2];
    for (int i = 0; i < 2; ++i)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7);
    return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6) + __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7);
}
#endif

/* Ask for the next block of a sequence (its kv heads [kv0, kv1)) while this one is used: blocks sit at
 * random places in the cache, and the hardware prefetcher does not follow a jump. Into L2 (hint 2): that
 * measured ~20% faster than no prefetch, into L1 (hint 3) no faster than none. */
static inline void prefetch_block(const float *blk, const geom_t *geo, int kv0, int kv1) {
    const int64_t width = (int64_t)(kv1 - kv0) * geo->head_dim;
    for (int j = 0; j < geo->block_size; ++j) {
        const float *row = blk + j * geo->tok + (int64_t)kv0 * geo->head_dim;
        for (int64_t i = 0; i < width; i += 16) __builtin_prefetch(row + i, 0, 2);
    }
}

/* head_dim D a multiple of CB_VW, fixed at compile time (C = D / CB_VW vectors per row). Both passes walk the
 * sequence block by block (a block holds all kv heads of block_size tokens, one contiguous run that stays
 * in L1 while it is used) and keep what they reuse in registers:
 *  - scores: per query head and chunk of CB_VW cached tokens, CB_VW dot-product accumulators, reduced
 *    together. Where the register file holds the query's C vectors beside them with one to spare
 *    (CB_QK_QREG: AVX-512), the query stays in registers and the tokens go one by one; otherwise (AVX2,
 *    scalar) the chunk goes one query vector at a time, each read once and used for all of its tokens.
 *  - values: the head's row in slices of CS = min(C, CB_PV_ACC) vectors (the whole row on AVX-512; on AVX2
 *    and scalar 8 vectors, 1 to 4 slices); per slice and group of up to CB_PV_ACC / CS query heads, their
 *    output slices as accumulators over the block's tokens, each value slice loaded once per group. */
#define CB_PV_ACC (CB_VREGS / 2) /* accumulator vectors of the value pass: 16 on AVX-512, 8 otherwise */
#define CB_QK_QREG(D) ((D) / CB_VW + CB_VW < CB_VREGS) /* the scores pass keeps the query in registers */
#define CB_SEQ_KERNELS(D)                                                                                         \
    _Static_assert((D) % CB_VW == 0 && ((D) / CB_VW <= CB_PV_ACC || (D) / CB_VW % CB_PV_ACC == 0),                \
                   "head_dim " #D " does not split into the vector width's blocks");                              \
    static inline __attribute__((always_inline)) vf qk_chunk_##D(const int m, const vf *qv, const float *kp,      \
                                                                 int64_t tok) {                                   \
        enum { C = (D) / CB_VW };                                                                                 \
        vf acc[CB_VW];                                                                                            \
        if (CB_QK_QREG(D)) { /* token by token */                                                                 \
            for (int j = 0; j < CB_VW; ++j) {                                                                     \
                acc[j] = (vf){0};                                                                                 \
                if (j < m)                                                                                        \
                    for (int c = 0; c < C; ++c) acc[j] += qv[c] * cb_load(kp + j * tok + CB_VW * c);              \
            }                                                                                                     \
        } else { /* query vector by query vector */                                                               \
            for (int j = 0; j < CB_VW; ++j) acc[j] = (vf){0};                                                     \
            for (int c = 0; c < C; ++c)                                                                           \
                for (int j = 0; j < CB_VW; ++j)                                                                   \
                    if (j < m) acc[j] += qv[c] * cb_load(kp + j * tok + CB_VW * c);                               \
        }                                                                                                         \
        return reduce_vw(acc);                                                                                    \
    }                                                                                                             \
    static void qk_seq_##D(const float *restrict q, const float *restrict k_cache, const int32_t *restrict bt,     \
                           int len, const geom_t *geo, int kv0, int kv1, float *restrict scores) {                 \
        enum { C = (D) / CB_VW };                                                                                 \
        const int group = geo->num_heads / geo->num_kv_heads, bs = geo->block_size;                               \
        for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {                                                        \
            const int n = len - t0 < bs ? len - t0 : bs, up = (n + CB_VW - 1) / CB_VW * CB_VW;                   \
            const int nc = up < bs ? up : bs; /* keys scored: to a whole chunk, in the block (see decode_run) */  \
            const float *kb = k_cache + (int64_t)bt[b] * geo->blk;                                                \
            if (t0 + bs < len) prefetch_block(k_cache + (int64_t)bt[b + 1] * geo->blk, geo, kv0, kv1);            \
            for (int kvh = kv0; kvh < kv1; ++kvh)                                                                 \
                for (int h = kvh * group; h < (kvh + 1) * group; ++h) {                                           \
                    vf qv[C];                                                                                     \
                    for (int c = 0; c < C; ++c) qv[c] = cb_load(q + (int64_t)h * (D) + CB_VW * c) * geo->scale;   \
                    float *sc = scores + (int64_t)h * geo->ld + t0;                                               \
                    for (int j0 = 0; j0 < nc; j0 += CB_VW) {                                                      \
                        const float *kp = kb + j0 * geo->tok + kvh * (D);                                         \
                        if (nc - j0 >= CB_VW) {                                                                   \
                            cb_store(sc + j0, qk_chunk_##D(CB_VW, qv, kp, geo->tok));                             \
                        } else { /* the block's last keys, block_size not a multiple of CB_VW */                  \
                            const vf s = qk_chunk_##D(nc - j0, qv, kp, geo->tok);                                 \
                            for (int j = 0; j < nc - j0; ++j) sc[j0 + j] = s[j];                                  \
                        }                                                                                         \
                    }                                                                                             \
                }                                                                                                 \
        }                                                                                                         \
    }                                                                                                             \
    static inline __attribute__((always_inline)) void pv_heads_##D(                                               \
        const int nh, const float *restrict probs, const float *restrict vb, int n, int t0, const geom_t *geo,     \
        int h0, int s, float *restrict o) {                                                                       \
        enum { C = (D) / CB_VW, CS = C < CB_PV_ACC ? C : CB_PV_ACC };                                             \
        vf acc[CB_PV_ACC / CS][CS];                                                                               \
        for (int hh = 0; hh < nh; ++hh)                                                                           \
            for (int c = 0; c < CS; ++c)                                                                          \
                acc[hh][c] = t0 ? cb_load(o + (int64_t)(h0 + hh) * (D) + CB_VW * (s + c)) : (vf){0};              \
        for (int j = 0; j < n; ++j) {                                                                             \
            vf vv[CS];                                                                                            \
            for (int c = 0; c < CS; ++c) vv[c] = cb_load(vb + j * geo->tok + CB_VW * (s + c));                    \
            for (int hh = 0; hh < nh; ++hh) {                                                                     \
                const float w = probs[(int64_t)(h0 + hh) * geo->ld + t0 + j];                                     \
                for (int c = 0; c < CS; ++c) acc[hh][c] += w * vv[c];                                             \
            }                                                                                                     \
        }                                                                                                         \
        for (int hh = 0; hh < nh; ++hh)                                                                           \
            for (int c = 0; c < CS; ++c) cb_store(o + (int64_t)(h0 + hh) * (D) + CB_VW * (s + c), acc[hh][c]);    \
    }                                                                                                             \
    static void pv_seq_##D(const float *restrict probs, const float *restrict v_cache, const int32_t *restrict bt, \
                           int len, const geom_t *geo, int kv0, int kv1, float *restrict o) {                      \
        enum { C = (D) / CB_VW, CS = C < CB_PV_ACC ? C : CB_PV_ACC, HMAX = CB_PV_ACC / CS };                      \
        const int group = geo->num_heads / geo->num_kv_heads, bs = geo->block_size;                               \
        for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {                                                        \
            const int n = len - t0 < bs ? len - t0 : bs;                                                          \
            if (t0 + bs < len) prefetch_block(v_cache + (int64_t)bt[b + 1] * geo->blk, geo, kv0, kv1);            \
            for (int kvh = kv0; kvh < kv1; ++kvh) {                                                               \
                const float *vb = v_cache + (int64_t)bt[b] * geo->blk + kvh * (D);                                \
                for (int s = 0; s < C; s += CS) /* the head's row, CS vectors at a time */                        \
                    for (int h0 = kvh * group; h0 < (kvh + 1) * group; h0 += HMAX) {                              \
                        const int nh = (kvh + 1) * group - h0 < HMAX ? (kvh + 1) * group - h0 : HMAX;             \
                        switch (nh) { /* the head count as a constant: accumulators in registers */               \
                        case 1: pv_heads_##D(1, probs, vb, n, t0, geo, h0, s, o); break;                          \
                        case 2: pv_heads_##D(2, probs, vb, n, t0, geo, h0, s, o); break;                          \
                        case 3: pv_heads_##D(3, probs, vb, n, t0, geo, h0, s, o); break;                          \
                        default: pv_heads_##D(HMAX, probs, vb, n, t0, geo, h0, s, o); break;                      \
                        }                                                                                         \
                    }                                                                                             \
            }                                                                                                     \
        }                                                                                                         \
    }

CB_SEQ_KERNELS(64)
CB_SEQ_KERNELS(128)

/* Any head_dim: every head in turn. */
static void qk_seq_any(const float *restrict q, const float *restrict k_cache, const int32_t *restrict bt, int len,
                       const geom_t *geo, int kv0, int kv1, float *restrict scores) {
    const int group = geo->num_heads / geo->num_kv_heads;
    for (int h = kv0 * group; h < kv1 * group; ++h)
        qk_head_any(q + (int64_t)h * geo->head_dim, k_cache, bt, len, geo, h / group, scores + h * geo->ld);
}

static void pv_seq_any(const float *restrict probs, const float *restrict v_cache, const int32_t *restrict bt,
                       int len, const geom_t *geo, int kv0, int kv1, float *restrict o) {
    const int group = geo->num_heads / geo->num_kv_heads;
    for (int h = kv0 * group; h < kv1 * group; ++h)
        pv_head_any(probs + h * geo->ld, v_cache, bt, len, geo, h / group, o + (int64_t)h * geo->head_dim);
}

typedef void (*qk_fn)(const float *, const float *, const int32_t *, int, const geom_t *, int, int, float *);
typedef void (*pv_fn)(const float *, const float *, const int32_t *, int, const geom_t *, int, int, float *);

static void softmax_inplace(float *restrict sc, int len) {
    float m = sc[0];
#pragma omp simd reduction(max : m)
    for (int t = 1; t < len; ++t) m = sc[t] > m ? sc[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; ++t) {
        sc[t] = cb_exp(sc[t] - m);
        sum += sc[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int t = 0; t < len; ++t) sc[t] *= inv;
}

#define CB_ROW_RUN 8 /* rows of one sequence attended together at most */

/* A run of `rows` rows of one sequence (row r: context length len + r, query q + r * q_stride, output
 * o + r * o_stride), the query heads of kv heads [kv0, kv1): scores, a softmax per head, the weighted values.
 * More than one row: their heads are packed as rows * group heads per kv head (qbuf, obuf), so the passes
 * read each block once for all. With a sliding window (geo->window > 0) only a row's last `window` keys
 * count: the passes start at the block holding the first row's first one, and earlier keys get probability 0.
 * The scores pass takes a block's keys in whole chunks of CB_VW as far as the block goes, past the last key
 * walked (those scores land at the end of a head's row of scores, g.ld floats long): how a key's score is
 * computed then depends on the block size and the key's place in its block alone, not on how many keys the
 * passes walk, so each row of a run gets the scores it gets alone, bit for bit. */
static void decode_run(const float *q, int64_t q_stride, float *o, int64_t o_stride, int rows, const float *k_cache,
                       const float *v_cache, const int32_t *bt, int len, const geom_t *geo, int kv0, int kv1, qk_fn qk,
                       pv_fn pv, float *scores, float *qbuf, float *obuf) {
    const int group = geo->num_heads / geo->num_kv_heads, d = geo->head_dim;
    geom_t g = *geo;
    g.num_heads = geo->num_heads * rows;
    const int lo = geo->window > 0 && len > geo->window ? len - geo->window : 0, b0 = lo / geo->block_size;
    const int span = len + rows - 1 - b0 * geo->block_size; /* keys the passes walk: the last row's */
    g.ld = span + CB_VW - 1; /* a head's row of scores: those keys and the rest of a last whole chunk */
    bt += b0;
    const float *qp = q;
    float *op = o;
    if (rows > 1) { /* packed head (kvh, r, j) = row r's head kvh * group + j */
        for (int kvh = kv0; kvh < kv1; ++kvh)
            for (int r = 0; r < rows; ++r)
                memcpy(qbuf + ((int64_t)(kvh * rows + r) * group) * d, q + r * q_stride + (int64_t)kvh * group * d,
                       sizeof(float) * (size_t)(group * d));
        qp = qbuf;
        op = obuf;
    }
    qk(qp, k_cache, bt, span, &g, kv0, kv1, scores);
    for (int kvh = kv0; kvh < kv1; ++kvh)
        for (int r = 0; r < rows; ++r) {
            const int lr = len + r, lo_r = geo->window > 0 && lr > geo->window ? lr - geo->window : 0;
            const int skip = lo_r - b0 * geo->block_size, end = lr - b0 * geo->block_size;
            for (int j = 0; j < group; ++j) {
                float *sc = scores + (int64_t)((kvh * rows + r) * group + j) * g.ld;
                if (geo->softcap > 0.0f) {
                    const float cap = geo->softcap, inv = 1.0f / geo->softcap;
                    for (int t = skip; t < end; ++t) sc[t] = cap * tanhf(sc[t] * inv);
                }
                softmax_inplace(sc + skip, end - skip);
                memset(sc, 0, sizeof(float) * (size_t)skip);
                memset(sc + end, 0, sizeof(float) * (size_t)(span - end));
            }
        }
    pv(scores, v_cache, bt, span, &g, kv0, kv1, op);
    if (rows > 1)
        for (int kvh = kv0; kvh < kv1; ++kvh)
            for (int r = 0; r < rows; ++r)
                memcpy(o + r * o_stride + (int64_t)kvh * group * d, obuf + ((int64_t)(kvh * rows + r) * group) * d,
                       sizeof(float) * (size_t)(group * d));
}

/* Rows [i, i + n) that can run together: context lengths +1 each and the same blocks (the last row's). */
static int run_length(const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, int num_seqs, int i,
                      int block_size) {
    int n = 1;
    while (n < CB_ROW_RUN && i + n < num_seqs && seq_lens[i + n] == seq_lens[i] + n && seq_lens[i] >= 1) {
        const int nb = (seq_lens[i + n] + block_size - 1) / block_size;
        if (memcmp(block_tables + (int64_t)i * bt_stride, block_tables + (int64_t)(i + n) * bt_stride,
                   sizeof(int32_t) * (size_t)nb) != 0)
            break;
        ++n;
    }
    return n;
}

static int blocks_in_range(const int32_t *bt, int len, int block_size, int num_blocks) {
    const int nblocks = (len + block_size - 1) / block_size;
    for (int b = 0; b < nblocks; ++b)
        if (bt[b] < 0 || bt[b] >= num_blocks) return 0;
    return 1;
}

/* Returns 0 on success; 1: scratch memory could not be allocated; 2: invalid shapes; 3: a sequence length
 * outside [1, max_seq_len] or a block id outside the cache (those sequences are left unwritten). */
int cb_paged_decode_f32(const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride,
                        const float *k_cache, const float *v_cache, int num_blocks, const int32_t *block_tables,
                        int64_t bt_stride, const int32_t *seq_lens, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int block_size, float scale, int max_seq_len, int window, float softcap) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || block_size < 1 ||
        max_seq_len < 1 || num_blocks < 1 || window < 0 || softcap < 0.0f)
        return CB_EINVAL;
    const int64_t tok = (int64_t)num_kv_heads * head_dim;
    const geom_t geo = {
        num_heads, num_kv_heads, head_dim, block_size, tok, tok * block_size, scale, window, softcap, 0};
    qk_fn qk = qk_seq_any;
    pv_fn pv = pv_seq_any;
    if (head_dim == 64) {
        qk = qk_seq_64;
        pv = pv_seq_64;
    } else if (head_dim == 128) {
        qk = qk_seq_128;
        pv = pv_seq_128;
    }
    /* Runs of rows of one sequence (see the top): run r is rows [start[r], start[r + 1]). */
    int *start = malloc(sizeof(int) * (size_t)(num_seqs + 1));
    if (start == NULL) return CB_ENOMEM;
    int runs = 0, longest = 1;
    for (int i = 0; i < num_seqs; ++runs) {
        start[runs] = i;
        const int n = run_length(block_tables, bt_stride, seq_lens, num_seqs, i, block_size);
        longest = n > longest ? n : longest;
        i += n;
    }
    start[runs] = num_seqs;
    /* Fewer runs than twice the threads (one long chat, say): split each run's kv heads too. */
    const int threads = cb_max_threads();
    int parts = 1;
    if (runs > 0 && runs < 2 * threads) parts = (2 * threads + runs - 1) / runs;
    if (parts > num_kv_heads) parts = num_kv_heads;
    const int items = runs * parts;
    const size_t heads = (size_t)longest * (size_t)num_heads; /* of the longest run, packed */
    const size_t packed = heads * (size_t)head_dim;
    const size_t nscores = heads * ((size_t)max_seq_len + CB_VW); /* rows of scores (decode_run's g.ld floats) */
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (nscores + 2 * packed));
        if (scores == NULL) {
#pragma omp atomic write
            failed = CB_ENOMEM;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int run = item / parts, part = item % parts, i = start[run], rows = start[run + 1] - i;
            const int len = seq_lens[i], last = seq_lens[i + rows - 1];
            const int32_t *bt = block_tables + (int64_t)i * bt_stride;
            if (scores == NULL) continue;
            if (len < 1 || last > max_seq_len || !blocks_in_range(bt, last, block_size, num_blocks)) {
#pragma omp atomic write
                failed = CB_ERANGE;
                continue;
            }
            const int kv0 = part * num_kv_heads / parts, kv1 = (part + 1) * num_kv_heads / parts;
            float *qbuf = scores + nscores;
            decode_run(q + (int64_t)i * q_row_stride, q_row_stride, out + (int64_t)i * out_row_stride, out_row_stride,
                       rows, k_cache, v_cache, bt, len, &geo, kv0, kv1, qk, pv, scores, qbuf, qbuf + packed);
        }
        free(scores);
    }
    free(start);
    return failed;
}
