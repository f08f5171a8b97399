/* Paged decode attention for CPUs (float32): one query token per sequence, keys and values read in place
 * from the paged KV cache. Built and loaded by cpu_native.py (gcc/cc, -O3 -march=native -fopenmp).
 *
 * Layouts (all contiguous unless a stride is given):
 *   q            [num_seqs, num_heads, head_dim], rows q_row_stride floats apart
 *   out          [num_seqs, num_heads, head_dim], rows out_row_stride floats apart
 *   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, bt_stride] int32;  seq_lens [num_seqs] int32 (>= 1)
 *
 * Sequences are spread over OpenMP threads (the same libgomp torch uses, so the same thread pool). Per
 * sequence: scores of every head against every cached token, block by block; a softmax per head; then the
 * probability-weighted sum of the values, block by block. For head_dim 64 and 128 (vectorised paths) each
 * cache block is read once per pass as one contiguous run of memory (all kv heads of its tokens); other
 * head sizes go head by head. Software prefetching of the next block measured slower than leaving it to
 * the hardware prefetcher, so there is none.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>

#define CB_LOG2E 1.44269504088896341f
#define CB_LN2_HI 0.693359375f
#define CB_LN2_LO (-2.12194440e-4f)

/* exp(x) for x <= 0 (Cephes' polynomial, ~1e-7 relative error), written so that loops over it vectorize. */
static inline float cb_exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * CB_LOG2E + 0.5f);
    const float r = x - n * CB_LN2_HI - n * CB_LN2_LO;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return y * scale.f;
}

typedef struct {
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t tok, blk; /* floats between consecutive tokens of a block, and between blocks */
    float scale;
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

/* head_dim a multiple of 16, fixed at compile time: the query row and the output accumulator live in
 * vector registers (GCC vector extensions: AVX-512, AVX2 or SSE, whatever -march allows). */
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));

static inline vf16 load16(const float *p) { return *(const vf16 *)p; }

static inline float hsum16(vf16 v) {
    const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

#define CB_SEQ_KERNELS(D)                                                                                         \
    static void qk_seq_##D(const float *restrict q, const float *restrict k_cache, const int32_t *restrict bt,     \
                           int len, const geom_t *geo, int kv0, int kv1, float *restrict scores) {                 \
        const int group = geo->num_heads / geo->num_kv_heads, bs = geo->block_size;                               \
        for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {                                                        \
            const int n = len - t0 < bs ? len - t0 : bs;                                                          \
            const float *kb = k_cache + (int64_t)bt[b] * geo->blk;                                                \
            for (int j = 0; j < n; ++j) {                                                                         \
                for (int kvh = kv0; kvh < kv1; ++kvh) {                                                           \
                    const float *kp = kb + j * geo->tok + kvh * (D);                                              \
                    vf16 kv[D / 16];                                                                              \
                    for (int c = 0; c < D / 16; ++c) kv[c] = load16(kp + 16 * c);                                 \
                    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {                                       \
                        const float *qh = q + (int64_t)h * (D);                                                   \
                        vf16 acc = load16(qh) * kv[0];                                                            \
                        for (int c = 1; c < D / 16; ++c) acc += load16(qh + 16 * c) * kv[c];                      \
                        scores[(int64_t)h * len + t0 + j] = hsum16(acc) * geo->scale;                             \
                    }                                                                                             \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
    static void pv_seq_##D(const float *restrict probs, const float *restrict v_cache, const int32_t *restrict bt, \
                           int len, const geom_t *geo, int kv0, int kv1, float *restrict o) {                      \
        const int group = geo->num_heads / geo->num_kv_heads, bs = geo->block_size;                               \
        memset(o + (int64_t)kv0 * group * (D), 0, sizeof(float) * (size_t)((kv1 - kv0) * group * (D)));           \
        for (int t0 = 0, b = 0; t0 < len; t0 += bs, ++b) {                                                        \
            const int n = len - t0 < bs ? len - t0 : bs;                                                          \
            const float *vb = v_cache + (int64_t)bt[b] * geo->blk;                                                \
            for (int j = 0; j < n; ++j) {                                                                         \
                for (int kvh = kv0; kvh < kv1; ++kvh) {                                                           \
                    const float *vp = vb + j * geo->tok + kvh * (D);                                              \
                    vf16 vv[D / 16];                                                                              \
                    for (int c = 0; c < D / 16; ++c) vv[c] = load16(vp + 16 * c);                                 \
                    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {                                       \
                        const float w = probs[(int64_t)h * len + t0 + j];                                         \
                        vf16 *oh = (vf16 *)(o + (int64_t)h * (D));                                                \
                        for (int c = 0; c < D / 16; ++c) oh[c] += w * vv[c];                                      \
                    }                                                                                             \
                }                                                                                                 \
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
        qk_head_any(q + (int64_t)h * geo->head_dim, k_cache, bt, len, geo, h / group, scores + (int64_t)h * len);
}

static void pv_seq_any(const float *restrict probs, const float *restrict v_cache, const int32_t *restrict bt,
                       int len, const geom_t *geo, int kv0, int kv1, float *restrict o) {
    const int group = geo->num_heads / geo->num_kv_heads;
    for (int h = kv0 * group; h < kv1 * group; ++h)
        pv_head_any(probs + (int64_t)h * len, v_cache, bt, len, geo, h / group, o + (int64_t)h * geo->head_dim);
}

typedef void (*qk_fn)(const float *, const float *, const int32_t *, int, const geom_t *, int, int, float *);
typedef void (*pv_fn)(const float *, const float *, const int32_t *, int, const geom_t *, int, int, float *);

static void softmax_inplace(float *restrict sc, int len) {
    float m = sc[0];
    for (int t = 1; t < len; ++t) m = sc[t] > m ? sc[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; ++t) {
        sc[t] = cb_exp_nonpos(sc[t] - m);
        sum += sc[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int t = 0; t < len; ++t) sc[t] *= inv;
}

/* One sequence, the query heads of kv heads [kv0, kv1): scores, a softmax per head, the weighted values. */
static void decode_sequence(const float *q, float *o, const float *k_cache, const float *v_cache, const int32_t *bt,
                            int len, const geom_t *geo, int kv0, int kv1, qk_fn qk, pv_fn pv, float *scores) {
    const int group = geo->num_heads / geo->num_kv_heads;
    qk(q, k_cache, bt, len, geo, kv0, kv1, scores);
    for (int h = kv0 * group; h < kv1 * group; ++h) softmax_inplace(scores + (int64_t)h * len, len);
    pv(scores, v_cache, bt, len, geo, kv0, kv1, o);
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
                        int head_dim, int block_size, float scale, int max_seq_len) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || block_size < 1 ||
        max_seq_len < 1 || num_blocks < 1)
        return 2;
    const int64_t tok = (int64_t)num_kv_heads * head_dim;
    const geom_t geo = {num_heads, num_kv_heads, head_dim, block_size, tok, tok * block_size, scale};
    qk_fn qk = qk_seq_any;
    pv_fn pv = pv_seq_any;
    if (head_dim == 64) {
        qk = qk_seq_64;
        pv = pv_seq_64;
    } else if (head_dim == 128) {
        qk = qk_seq_128;
        pv = pv_seq_128;
    }
    /* Fewer sequences than twice the threads (one long chat, say): split each sequence's kv heads too. */
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int parts = 1;
    if (num_seqs > 0 && num_seqs < 2 * threads) parts = (2 * threads + num_seqs - 1) / num_seqs;
    if (parts > num_kv_heads) parts = num_kv_heads;
    const int items = num_seqs * parts;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)max_seq_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const int i = item / parts, part = item % parts;
            const int len = seq_lens[i];
            const int32_t *bt = block_tables + (int64_t)i * bt_stride;
            if (scores == NULL) continue;
            if (len < 1 || len > max_seq_len || !blocks_in_range(bt, len, block_size, num_blocks)) {
#pragma omp atomic write
                failed = 3;
                continue;
            }
            const int kv0 = part * num_kv_heads / parts, kv1 = (part + 1) * num_kv_heads / parts;
            decode_sequence(q + (int64_t)i * q_row_stride, out + (int64_t)i * out_row_stride, k_cache, v_cache, bt,
                            len, &geo, kv0, kv1, qk, pv, scores);
        }
        free(scores);
    }
    return failed;
}
