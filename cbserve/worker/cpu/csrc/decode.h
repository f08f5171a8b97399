/* Decoding packed weights to float32 vectors, for the chunk decoder (panels.c) and the few-row products that
 * decode in registers (rows.c). Internal to the kernels. Each format's value is one inline expression used
 * by both, so the two paths multiply by the same float32 weights bit for bit. */
#ifndef CB_DECODE_H
#define CB_DECODE_H

#include "cb_simd.h"
#include "panels.h"

#if CB_VW >= 8
#include <immintrin.h>
#endif

/* CB_VW integers of 8 or 16 bits widened to int32 lanes. GCC turns __builtin_convertvector from 8-bit lanes
 * into scalar code, so these use the widening loads where the level has them. */
#if CB_VW == 16
static inline vi widen_u8(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi widen_s8(const int8_t *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi widen_u16(const uint16_t *p) {
    return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
}
#elif CB_VW == 8
static inline vi widen_u8(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi widen_s8(const int8_t *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi widen_u16(const uint16_t *p) {
    return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
}
#else
#define CB_WIDEN(name, type)                                  \
    static inline vi name(const type *p) {                    \
        vi r;                                                 \
        for (int i = 0; i < CB_VW; ++i) r[i] = (int32_t)p[i]; \
        return r;                                             \
    }
CB_WIDEN(widen_u8, uint8_t)
CB_WIDEN(widen_s8, int8_t)
CB_WIDEN(widen_u16, uint16_t)
#endif

static inline vf to_float(vi v) { return __builtin_convertvector(v, vf); }
static inline vi load_bits(const void *p) {
    vi r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline void store_bits(float *p, vi v) { memcpy(p, &v, sizeof v); }

#define CB_PV (CB_NR / CB_VW) /* vectors per panel row */

/* Block layouts (panels.h): float16 scales, then the values at the *_Q offset. */
#define Q8_Q (CB_NR * 2)                           /* after d[48] */
#define Q8_BLOCK_BYTES (Q8_Q + CB_QK * CB_NR)      /* d[48] + q[32][48] = 1632 */
#define Q41_Q (2 * CB_NR * 2)                      /* after d[48], m[48] */
#define Q41_BLOCK_BYTES (Q41_Q + CB_QK / 2 * CB_NR) /* d[48] + m[48] + q[16][48] = 960 */
#define Q40_Q (CB_NR * 2)                          /* after d[48] */
#define Q40_BLOCK_BYTES (Q40_Q + CB_QK / 2 * CB_NR) /* d[48] + q[16][48] = 864 */

/* CB_VW float16 values as float32 (exact: every float16 is a float32). */
#if CB_VW == 16
static inline vf half_value(const uint16_t *p) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif CB_VW == 8
static inline vf half_value(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vf half_value(const uint16_t *p) {
    vf r;
    for (int i = 0; i < CB_VW; ++i) r[i] = cb_half_to_float(p[i]);
    return r;
}
#endif

/* The weights of CB_VW columns. Q4_1: one byte per column holds k = 2j (low nibble) and k = 2j + 1 (high);
 * d * q is exact (an 11-bit float16 significand times 4 bits), so the one rounding is in the add. Q4_0 is
 * d * (q - 8), decoded as Q4_1 with m = -8d (q4_0_offset): d * q and -8d are exact and so is their sum, d * (q - 8)
 * itself, in one FMA (but +0 where gguf-py gives -0: q = 8 with a negative d). Q8_0: d * q, exact. bfloat16:
 * the upper halves of float32 values. */
static inline vf q4_1_low(vf d, vf m, vi pair) { return d * to_float(pair & 15) + m; }
static inline vf q4_1_high(vf d, vf m, vi pair) { return d * to_float(pair >> 4) + m; }
static inline vf q4_0_offset(vf d) { return d * -8.0f; }
static inline vf q8_0_value(vf d, const int8_t *q) { return d * to_float(widen_s8(q)); }

/* The K-quants (panels.h): super-blocks of CB_QKK k values, a header of float16 scales then CB_KSUB blocks of 32. */
#define CB_QKK 256
#define CB_KSUB (CB_QKK / CB_QK)
#define Q4K_HEAD (2 * CB_NR * 2)                     /* d[48], dmin[48] */
#define Q4K_Q (2 * CB_NR)                            /* a block: sc[48], m[48], then q[16][48] */
#define Q4K_BLOCK (Q4K_Q + CB_QK / 2 * CB_NR)        /* 864 */
#define Q4K_SUPER (Q4K_HEAD + CB_KSUB * Q4K_BLOCK)   /* 7104 */
#define Q5K_QH Q4K_BLOCK                             /* Q5_K: Q4_K's block, then qh[4][48] */
#define Q5K_BLOCK (Q5K_QH + CB_QK / 8 * CB_NR)       /* 1056 */
#define Q5K_SUPER (Q4K_HEAD + CB_KSUB * Q5K_BLOCK)   /* 8640 */
#define Q50_Q (CB_NR * 2)                            /* Q5_0: d[48], q[16][48], qh[4][48] */
#define Q50_QH (Q50_Q + CB_QK / 2 * CB_NR)
#define Q50_BLOCK (Q50_QH + CB_QK / 8 * CB_NR)       /* 1056 */
#define Q6K_HEAD (CB_NR * 2)                         /* d[48] */
#define Q6K_QL (2 * CB_NR)                           /* a block: sc[2][48], then ql[16][48], then qh[8][48] */
#define Q6K_QH (Q6K_QL + CB_QK / 2 * CB_NR)
#define Q6K_BLOCK (Q6K_QH + CB_QK / 4 * CB_NR)       /* 1248 */
#define Q6K_SUPER (Q6K_HEAD + CB_KSUB * Q6K_BLOCK)   /* 10080 */

/* Block b's super-block header, and the block's own bytes (head: the header's size, bytes: a block's). */
static inline const uint8_t *kq_head(const uint8_t *panel, int64_t super, int b) {
    return panel + (int64_t)(b / CB_KSUB) * super;
}
static inline const uint8_t *kq_block(const uint8_t *panel, int64_t super, int head, int bytes, int b) {
    return kq_head(panel, super, b) + head + (b % CB_KSUB) * bytes;
}
/* Q4_K: a block's scale d * sc and offset -(dmin * m), exact in float32 (an 11-bit significand times 6 bits),
 * then decoded as Q4_1: d sc q is exact too (21 bits), so the one rounding is the add's, as in gguf-py's
 * d * q - dm. Q6_K: d * sc (18 bits) times q - 32 (6 bits), exact; q's low 4 bits are a nibble of the pair's
 * byte (as Q4's), its high 2 bits in qh's byte [j / 2] at bits 4 (j % 2) (k = 2j) and 4 (j % 2) + 2 (k = 2j + 1). */
static inline vf q4_k_scale(vf d, const uint8_t *sc) { return d * to_float(widen_u8(sc)); }
static inline vf q4_k_offset(vf dmin, const uint8_t *m) { return -(dmin * to_float(widen_u8(m))); }
/* Q5_K: Q4_K's pair of nibbles j, each with its fifth bit from qh's byte [j / 4] (bit t: k = 8 (j / 4) + t, so
 * bits 2 (j % 4) and 2 (j % 4) + 1), moved to bit 4 from h4 = the byte shifted left 4. d sc q: 22 bits, exact. */
static inline vi q5_k_fifth(vi h4, int bit) { return (h4 >> bit) & 16; }
/* A 5-bit format's (Q5_K, Q5_0) values k = 2j and 2j + 1: the pair's nibbles with their fifth bits from h4. */
static inline vi q5_low(vi pair, vi h4, int j) { return (pair & 15) | q5_k_fifth(h4, 2 * (j % 4)); }
static inline vi q5_high(vi pair, vi h4, int j) { return (pair >> 4) | q5_k_fifth(h4, 2 * (j % 4) + 1); }
static inline vf q6_k_scale(vf d, const int8_t *sc) { return d * to_float(widen_s8(sc)); }
/* d sc q - 32 d sc in one FMA: d sc q and 32 d sc are exact, and so is their difference, d sc (q - 32) (but +0
 * where gguf-py gives -0, as for Q4_0: q = 32 with a negative d sc). h's two
 * bits for k = 2j land at bits 4-5 by one shift: left 4 for even j (s = 0), none for odd (s = 4); k = 2j + 1's
 * by a shift left 2 or right 2. */
static inline vf q6_k_offset(vf d) { return d * -32.0f; }
static inline vf q6_k_low(vf d, vf off, vi pair, vi h, int s) {
    return d * to_float((pair & 15) | ((s ? h : h << 4) & 0x30)) + off;
}
static inline vf q6_k_high(vf d, vf off, vi pair, vi h, int s) {
    return d * to_float((pair >> 4) | ((s ? h >> 2 : h << 2) & 0x30)) + off;
}
static inline vf bf16_value(const uint16_t *src) {
    const vi bits = widen_u16(src) << 16;
    vf r;
    memcpy(&r, &bits, sizeof r);
    return r;
}

/* The few-row paths (rows.c, rows_i16.c): each block asks for the bytes CB_ROWS_AHEAD ahead into L2: one thread's
 * misses alone do not keep memory busy (one 80 MB product, one row, 4 KB ahead against none: 17.3 against 13.6 GB/s
 * with AVX-512, 12.1 against 9.4 with AVX2; Q8_0 19.7 against 14.4). 16 KB ahead against 4 KB, one row through 16
 * streamed copies of Llama-3.2-1B's layer (2-core Zen 4 EPYC, read bandwidth 32-36 GB/s, 9 interleaved rounds):
 * int16 rows Q4_0 26.7 -> 30.2 GB/s, Q4_K 29.1 -> 29.6; float32 rows Q4_0 17.1 -> 19.5, Q4_K 18.7 -> 19.6 (8 KB:
 * between). A few KB of each core's L2 (512 KB to 2 MB on the CPUs served). -D flags override both for timing. */
#ifndef CB_ROWS_AHEAD
#define CB_ROWS_AHEAD 16384
#endif
#ifndef CB_ROWS_HINT
#define CB_ROWS_HINT 2 /* prefetcht1: into L2 */
#endif

static inline void prefetch_ahead(const uint8_t *at, int bytes) {
    for (int off = 0; off < bytes; off += 64) __builtin_prefetch(at + CB_ROWS_AHEAD + off, 0, CB_ROWS_HINT);
}

/* v as computed: the compiler may not regroup the operations that made v with the ones that use it. The kernels
 * are built with -fassociative-math (../native.py), under which GCC turns a column's running sum
 * (acc + x0 w0) + x1 w1 into acc + (x0 w0 + x1 w1), or x (d q) into (x d) q: other bits than the tiled path's,
 * which sums each column in k order over weights stored to memory first. */
static inline vf cb_settled(vf v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+v"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#endif
    return v;
}

#endif
