/* Packing weights into the panel layouts of panels.h, and decoding panel chunks back to float32 for the
 * linear kernel (gemm.c) and for the load-time check that a packing is lossless (cb_unpack_panels). */
#include "i16.h"

int cb_storage_format(int fmt) {
    switch (fmt) {
    case CB_FMT_Q8_0_BF16: return CB_FMT_Q8_0;
    case CB_FMT_Q4_1_BF16: return CB_FMT_Q4_1;
    case CB_FMT_Q4_0_BF16: return CB_FMT_Q4_0;
    default: return fmt;
    }
}

static int is_block_format(int fmt) { return fmt == CB_FMT_Q8_0 || fmt == CB_FMT_Q4_1 || fmt == CB_FMT_Q4_0; }

int64_t cb_panel_bytes(int fmt, int k) {
    if ((fmt & CB_FMT_I16ALL) && !(fmt & CB_FMT_I16)) return -1;
    if (fmt & CB_FMT_I16) { /* its base format's bytes, regrouped */
        fmt &= ~CB_FMT_I16ALL;
        if (!cb_i16_format(fmt)) return -1;
    }
    fmt = cb_storage_format(fmt);
    if (cb_kquant(fmt)) return cb_kquant_panel_bytes(fmt, k);
    if (k < 1 || (is_block_format(fmt) && k % CB_QK)) return -1;
    switch (fmt) {
    case CB_FMT_F32: return (int64_t)k * CB_NR * 4;
    case CB_FMT_BF16: return (int64_t)k * CB_NR * 2;
    case CB_FMT_BF16_DOT: return (int64_t)((k + 1) / 2) * 2 * CB_NR * 2;
    case CB_FMT_Q8_0: return (int64_t)(k / CB_QK) * Q8_BLOCK_BYTES;
    case CB_FMT_Q4_1: return (int64_t)(k / CB_QK) * Q41_BLOCK_BYTES;
    case CB_FMT_Q4_0: return (int64_t)(k / CB_QK) * Q40_BLOCK_BYTES;
    default: return -1;
    }
}

int64_t cb_packed_bytes(int fmt, int n, int k) {
    const int64_t per_panel = cb_panel_bytes(fmt, k);
    return n < 1 || per_panel < 0 ? -1 : (int64_t)((n + CB_NR - 1) / CB_NR) * per_panel;
}

int cb_gemm_panel_width(void) { return CB_NR; }

/* ---- decoding --------------------------------------------------------------------------------------- */

static void chunk_bf16(const uint16_t *restrict src, int kn, float *restrict dst) {
    for (int i = 0; i < kn * CB_NR; i += CB_VW) cb_store(dst + i, bf16_value(src + i));
}

/* pairs [kn / 2][48][2] -> [kn][48] (kn even: the pad row of an odd k lands in the scratch's spare row). A pair
 * is one 32-bit word: k = 2j in its low half, 2j + 1 in its high half. */
static void chunk_bf16_dot(const uint16_t *restrict src, int kn, float *restrict dst) {
    const vi high = (vi){0} + (int32_t)0xFFFF0000u;
    for (int j = 0; j < (kn + 1) / 2; ++j)
        for (int c = 0; c < CB_NR; c += CB_VW) {
            const vi pair = load_bits(src + (j * CB_NR + c) * 2);
            store_bits(dst + (int64_t)(2 * j) * CB_NR + c, pair << 16);
            store_bits(dst + (int64_t)(2 * j + 1) * CB_NR + c, pair & high);
        }
}

static void chunk_q8_0(const uint8_t *restrict blocks, int kn, float *restrict dst) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q8_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)blocks;
        const int8_t *q = (const int8_t *)(blocks + Q8_Q);
        vf dv[CB_PV];
        for (int v = 0; v < CB_PV; ++v) dv[v] = half_value(d + CB_VW * v);
        for (int j = 0; j < CB_QK; ++j) {
            const int8_t *qj = q + j * CB_NR;
            float *o = dst + (int64_t)(b * CB_QK + j) * CB_NR;
            for (int v = 0; v < CB_PV; ++v) cb_store(o + CB_VW * v, q8_0_value(dv[v], qj + CB_VW * v));
        }
    }
}

static void chunk_q4_1(const uint8_t *restrict blocks, int kn, float *restrict dst) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q41_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)blocks, *m = d + CB_NR;
        const uint8_t *q = blocks + Q41_Q;
        for (int v = 0; v < CB_PV; ++v) {
            const vf dv = half_value(d + CB_VW * v), mv = half_value(m + CB_VW * v);
            for (int j = 0; j < CB_QK / 2; ++j) {
                const vi pair = widen_u8(q + j * CB_NR + CB_VW * v);
                float *o = dst + (int64_t)(b * CB_QK + 2 * j) * CB_NR + CB_VW * v;
                cb_store(o, q4_1_low(dv, mv, pair));
                cb_store(o + CB_NR, q4_1_high(dv, mv, pair));
            }
        }
    }
}

static void chunk_q4_0(const uint8_t *restrict blocks, int kn, float *restrict dst) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q40_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)blocks;
        const uint8_t *q = blocks + Q40_Q;
        for (int v = 0; v < CB_PV; ++v) {
            const vf dv = half_value(d + CB_VW * v), mv = q4_0_offset(dv);
            for (int j = 0; j < CB_QK / 2; ++j) {
                const vi pair = widen_u8(q + j * CB_NR + CB_VW * v);
                float *o = dst + (int64_t)(b * CB_QK + 2 * j) * CB_NR + CB_VW * v;
                cb_store(o, q4_1_low(dv, mv, pair));
                cb_store(o + CB_NR, q4_1_high(dv, mv, pair));
            }
        }
    }
}

/* In place: each of n float32 values rounded to the nearest bfloat16 (ties to even), as cb_round_bf16. */
static void round_bf16(float *x, int64_t n) {
    typedef uint32_t vu __attribute__((vector_size(CB_VW * 4), aligned(4)));
    for (int64_t i = 0; i < n; i += CB_VW) {
        vu bits;
        memcpy(&bits, x + i, sizeof bits);
        bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
        memcpy(x + i, &bits, sizeof bits);
    }
}

const float *cb_panel_chunk(int fmt, const uint8_t *panel, int k0, int kn, float *scratch) {
    if (fmt & CB_FMT_I16) /* panels_i16.c */
        return cb_i16_chunk(fmt & ~CB_FMT_I16ALL, panel, k0, kn, scratch);
    if (cb_bf16_blocks(fmt)) { /* decoded, then rounded as the kernel rounds */
        cb_panel_chunk(cb_storage_format(fmt), panel, k0, kn, scratch);
        round_bf16(scratch, (int64_t)kn * CB_NR);
        return scratch;
    }
    if (cb_kquant(fmt)) return cb_kquant_chunk(fmt, panel, k0, kn, scratch);
    switch (fmt) {
    case CB_FMT_F32: return (const float *)panel + (int64_t)k0 * CB_NR;
    case CB_FMT_BF16: chunk_bf16((const uint16_t *)panel + (int64_t)k0 * CB_NR, kn, scratch); return scratch;
    case CB_FMT_BF16_DOT:
        chunk_bf16_dot((const uint16_t *)panel + (int64_t)k0 * CB_NR, kn, scratch);
        return scratch;
    case CB_FMT_Q8_0: chunk_q8_0(panel + (int64_t)(k0 / CB_QK) * Q8_BLOCK_BYTES, kn, scratch); return scratch;
    case CB_FMT_Q4_0: chunk_q4_0(panel + (int64_t)(k0 / CB_QK) * Q40_BLOCK_BYTES, kn, scratch); return scratch;
    default: chunk_q4_1(panel + (int64_t)(k0 / CB_QK) * Q41_BLOCK_BYTES, kn, scratch); return scratch;
    }
}

#ifdef __AVX512BF16__
/* 16 float32 weights of k = 2j and of k = 2j + 1 -> the 16 columns' bfloat16 pairs, rounded to nearest even. */
static inline __m512i pair_vector(vf16 even, vf16 odd) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh((__m512)odd, (__m512)even); /* [even 0..15 | odd 0..15] */
    return _mm512_permutexvar_epi16(interleave, both);
}

static inline vf16 half16(const uint16_t *p) { return (vf16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* The decoded pairs of 16 columns: Q4_1 bytes (low nibble k = 2j, high nibble k = 2j + 1) with their scales d
 * and m (Q4_0's: d and q4_0_offset(d)); Q8_0 rows k = 2j and 2j + 1 with their scale d. One expression each, for the scratch path and the
 * one-row path alike (their results must agree bit for bit). */
static inline __m512i q4_1_pairs(vf16 d, vf16 m, const uint8_t *q) {
    const vi pair = widen_u8(q);
    return pair_vector(q4_1_low(d, m, pair), q4_1_high(d, m, pair));
}

static inline __m512i q8_0_pairs(vf16 d, const int8_t *even, const int8_t *odd) {
    return pair_vector(q8_0_value(d, even), q8_0_value(d, odd));
}

/* Q4_1 / Q4_0 blocks -> pairs: byte [j][c] already holds the pair (2j, 2j + 1) of column c in its two nibbles. */
static void pairs_q4_1(const uint8_t *restrict blocks, int kn, uint16_t *restrict out) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q41_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)blocks, *m = d + CB_NR;
        const uint8_t *q = blocks + Q41_Q;
        for (int v = 0; v < 3; ++v) {
            const vf16 dv = half16(d + 16 * v), mv = half16(m + 16 * v);
            for (int j = 0; j < CB_QK / 2; ++j)
                _mm512_storeu_si512(out + ((b * CB_QK / 2 + j) * CB_NR + 16 * v) * 2,
                                    q4_1_pairs(dv, mv, q + j * CB_NR + 16 * v));
        }
    }
}

static void pairs_q4_0(const uint8_t *restrict blocks, int kn, uint16_t *restrict out) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q40_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)blocks;
        const uint8_t *q = blocks + Q40_Q;
        for (int v = 0; v < 3; ++v) {
            const vf16 dv = half16(d + 16 * v), mv = q4_0_offset(dv);
            for (int j = 0; j < CB_QK / 2; ++j)
                _mm512_storeu_si512(out + ((b * CB_QK / 2 + j) * CB_NR + 16 * v) * 2,
                                    q4_1_pairs(dv, mv, q + j * CB_NR + 16 * v));
        }
    }
}

static void pairs_q8_0(const uint8_t *restrict blocks, int kn, uint16_t *restrict out) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q8_BLOCK_BYTES) {
        const uint16_t *d = (const uint16_t *)blocks;
        const int8_t *q = (const int8_t *)(blocks + Q8_Q);
        for (int v = 0; v < 3; ++v) {
            const vf16 dv = half16(d + 16 * v);
            for (int j = 0; j < CB_QK / 2; ++j)
                _mm512_storeu_si512(out + ((b * CB_QK / 2 + j) * CB_NR + 16 * v) * 2,
                                    q8_0_pairs(dv, q + 2 * j * CB_NR + 16 * v, q + (2 * j + 1) * CB_NR + 16 * v));
        }
    }
}

/* One row's pairs a against one block panel, the pairs fed to vdpbf16ps from registers; j runs inside the
 * column groups' loop so that the three sums are independent chains (each column still adds its k in order). */
static void q8_0_row_dot(const uint32_t *restrict a, int kp, const uint8_t *restrict panel, float *restrict acc48) {
    __m512 acc[3];
    for (int v = 0; v < 3; ++v) acc[v] = _mm512_loadu_ps(acc48 + 16 * v);
    for (int b = 0; b < kp / (CB_QK / 2); ++b, panel += Q8_BLOCK_BYTES, a += CB_QK / 2) {
        const uint16_t *d = (const uint16_t *)panel;
        const int8_t *q = (const int8_t *)(panel + Q8_Q);
        const vf16 dv[3] = {half16(d), half16(d + 16), half16(d + 32)};
        for (int j = 0; j < CB_QK / 2; ++j) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[j]);
            const int8_t *qe = q + 2 * j * CB_NR, *qo = qe + CB_NR;
            for (int v = 0; v < 3; ++v)
                acc[v] = _mm512_dpbf16_ps(acc[v], x, (__m512bh)q8_0_pairs(dv[v], qe + 16 * v, qo + 16 * v));
        }
    }
    for (int v = 0; v < 3; ++v) _mm512_storeu_ps(acc48 + 16 * v, acc[v]);
}

/* Q4_1 (q41 = 1) or Q4_0 (0, a compile-time constant once inlined): the nibbles decoded as cb_panel_pairs
 * decodes them. */
static inline __attribute__((always_inline)) void q4_row_dot(const int q41, const uint32_t *restrict a, int kp,
                                                             const uint8_t *restrict panel, float *restrict acc48) {
    const int bytes = q41 ? Q41_BLOCK_BYTES : Q40_BLOCK_BYTES;
    __m512 acc[3];
    for (int v = 0; v < 3; ++v) acc[v] = _mm512_loadu_ps(acc48 + 16 * v);
    for (int b = 0; b < kp / (CB_QK / 2); ++b, panel += bytes, a += CB_QK / 2) {
        const uint16_t *d = (const uint16_t *)panel, *m = d + CB_NR;
        const uint8_t *q = panel + (q41 ? Q41_Q : Q40_Q);
        const vf16 dv[3] = {half16(d), half16(d + 16), half16(d + 32)};
        vf16 mv[3];
        for (int v = 0; v < 3; ++v) mv[v] = q41 ? half16(m + 16 * v) : q4_0_offset(dv[v]);
        for (int j = 0; j < CB_QK / 2; ++j) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[j]);
            for (int v = 0; v < 3; ++v) {
                acc[v] = _mm512_dpbf16_ps(acc[v], x, (__m512bh)q4_1_pairs(dv[v], mv[v], q + j * CB_NR + 16 * v));
            }
        }
    }
    for (int v = 0; v < 3; ++v) _mm512_storeu_ps(acc48 + 16 * v, acc[v]);
}

void cb_blocks_row_dot(int fmt, const uint32_t *a, int kp, const uint8_t *panel, float *acc48) {
    if (fmt == CB_FMT_Q8_0_BF16)
        q8_0_row_dot(a, kp, panel, acc48);
    else if (fmt == CB_FMT_Q4_1_BF16)
        q4_row_dot(1, a, kp, panel, acc48);
    else
        q4_row_dot(0, a, kp, panel, acc48);
}

const uint16_t *cb_panel_pairs(int fmt, const uint8_t *panel, int k0, int kn, uint16_t *scratch) {
    switch (fmt) {
    case CB_FMT_BF16_DOT: return (const uint16_t *)panel + (int64_t)k0 * CB_NR;
    case CB_FMT_Q8_0_BF16: pairs_q8_0(panel + (int64_t)(k0 / CB_QK) * Q8_BLOCK_BYTES, kn, scratch); return scratch;
    case CB_FMT_Q4_0_BF16: pairs_q4_0(panel + (int64_t)(k0 / CB_QK) * Q40_BLOCK_BYTES, kn, scratch); return scratch;
    default: pairs_q4_1(panel + (int64_t)(k0 / CB_QK) * Q41_BLOCK_BYTES, kn, scratch); return scratch;
    }
}
#endif

/* packed (fmt, [n, k]) -> out [n, k] float32, rows ldo floats apart: what the kernel multiplies by. */
int cb_unpack_panels(int fmt, const uint8_t *packed, int n, int k, float *out, int64_t ldo) {
    const int64_t pbytes = cb_panel_bytes(fmt, k);
    if (n < 1 || pbytes < 0 || ldo < k) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        float scratch[(CB_QK + 1) * CB_NR] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < k; k0 += CB_QK) {
            const int kn = k - k0 < CB_QK ? k - k0 : CB_QK;
            const float *w = cb_panel_chunk(fmt, packed + p * pbytes, k0, kn, scratch);
            for (int j = 0; j < CB_NR && p * CB_NR + j < n; ++j)
                for (int kk = 0; kk < kn; ++kk) out[(int64_t)(p * CB_NR + j) * ldo + k0 + kk] = w[kk * CB_NR + j];
        }
    }
    return CB_OK;
}

/* ---- packing ---------------------------------------------------------------------------------------- */

/* w: [n, k] rows ldw floats apart -> out: cb_packed_bytes(CB_FMT_F32, n, k) bytes. */
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

/* As cb_pack_weight_f32, keeping the upper 16 bits of each value (the caller has checked that the lower
 * 16 are zero). */
int cb_pack_weight_bf16(const float *w, int64_t ldw, int n, int k, uint16_t *out) {
    if (n < 1 || k < 1 || ldw < k) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        uint16_t *dst = out + (int64_t)p * k * CB_NR;
        for (int kk = 0; kk < k; ++kk)
            for (int j = 0; j < CB_NR; ++j) {
                const int row = p * CB_NR + j;
                uint32_t bits = 0;
                if (row < n) memcpy(&bits, w + (int64_t)row * ldw + kk, 4);
                dst[(int64_t)kk * CB_NR + j] = (uint16_t)(bits >> 16);
            }
    }
    return CB_OK;
}

/* As cb_pack_weight_f32, rounded to bfloat16 and stored in k pairs (CB_FMT_BF16_DOT). */
int cb_pack_weight_bf16_dot(const float *w, int64_t ldw, int n, int k, uint16_t *out) {
    if (n < 1 || k < 1 || ldw < k) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, pairs = (k + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; ++p) {
        uint16_t *dst = out + (int64_t)p * pairs * 2 * CB_NR;
        for (int j = 0; j < pairs; ++j)
            for (int c = 0; c < CB_NR; ++c)
                for (int h = 0; h < 2; ++h) {
                    const int row = p * CB_NR + c, kk = 2 * j + h;
                    const float v = row < n && kk < k ? w[(int64_t)row * ldw + kk] : 0.0f;
                    dst[(j * CB_NR + c) * 2 + h] = cb_bf16_bits(v);
                }
    }
    return CB_OK;
}

/* The float16 bits of scale x into *h; 0 for the padding rows (valid = 0). Returns 0 when x is not a float16. */
static int half_scale(float x, int valid, uint16_t *h) {
    if (!valid) {
        *h = 0;
        return 1;
    }
    return cb_float_to_half_exact(x, h);
}

/* d: [n, k / 32] float32 scales (float16 values); q: [n, k] int8 -> out: cb_packed_bytes(CB_FMT_Q8_0, n, k). */
int cb_pack_q8_0(const float *d, const int8_t *q, int n, int k, uint8_t *out) {
    if (n < 1 || k < CB_QK || k % CB_QK) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, nb = k / CB_QK;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int p = 0; p < panels; ++p)
        for (int b = 0; b < nb; ++b) {
            uint8_t *blk = out + ((int64_t)p * nb + b) * Q8_BLOCK_BYTES;
            uint16_t *bd = (uint16_t *)blk;
            int8_t *bq = (int8_t *)(blk + Q8_Q);
            for (int j = 0; j < CB_NR; ++j) {
                const int row = p * CB_NR + j;
                bad |= !half_scale(row < n ? d[(int64_t)row * nb + b] : 0.0f, row < n, bd + j);
                for (int kk = 0; kk < CB_QK; ++kk)
                    bq[kk * CB_NR + j] = row < n ? q[(int64_t)row * k + b * CB_QK + kk] : 0;
            }
        }
    return bad ? CB_ERANGE : CB_OK;
}

/* The 4-bit formats: d (and m for Q4_1, else NULL) [n, k / 32] float32 (float16 values); q: [n, k] uint8 0..15. */
static int pack_q4(const float *d, const float *m, const uint8_t *q, int n, int k, uint8_t *out) {
    if (n < 1 || k < CB_QK || k % CB_QK) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, nb = k / CB_QK;
    const int64_t bytes = m ? Q41_BLOCK_BYTES : Q40_BLOCK_BYTES;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int p = 0; p < panels; ++p)
        for (int b = 0; b < nb; ++b) {
            uint8_t *blk = out + ((int64_t)p * nb + b) * bytes;
            uint16_t *bd = (uint16_t *)blk, *bm = bd + CB_NR;
            uint8_t *bq = blk + (m ? Q41_Q : Q40_Q);
            for (int j = 0; j < CB_NR; ++j) {
                const int row = p * CB_NR + j;
                const int64_t at = (int64_t)(row < n ? row : 0) * nb + b;
                bad |= !half_scale(d[at], row < n, bd + j);
                if (m) bad |= !half_scale(m[at], row < n, bm + j);
                const uint8_t *qr = q + (int64_t)(row < n ? row : 0) * k + b * CB_QK;
                for (int jj = 0; jj < CB_QK / 2; ++jj) {
                    const uint8_t lo = row < n ? qr[2 * jj] : 0, hi = row < n ? qr[2 * jj + 1] : 0;
                    bad |= (lo | hi) > 15;
                    bq[jj * CB_NR + j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
                }
            }
        }
    return bad ? CB_ERANGE : CB_OK;
}

/* d, m: [n, k / 32] float32; q: [n, k] uint8 values 0..15 -> out: cb_packed_bytes(CB_FMT_Q4_1, n, k) bytes. */
int cb_pack_q4_1(const float *d, const float *m, const uint8_t *q, int n, int k, uint8_t *out) {
    return pack_q4(d, m, q, n, k, out);
}

/* d: [n, k / 32] float32; q: [n, k] uint8 values 0..15 -> out: cb_packed_bytes(CB_FMT_Q4_0, n, k) bytes. */
int cb_pack_q4_0(const float *d, const uint8_t *q, int n, int k, uint8_t *out) { return pack_q4(d, NULL, q, n, k, out); }
