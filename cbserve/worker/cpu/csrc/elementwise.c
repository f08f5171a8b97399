/* The non-matmul ops of a Llama layer for CPUs (float32), each one pass over its rows: RMSNorm fused with
 * the residual add, SiLU(gate) * up, and rotary embeddings applied in place. In torch each of these is
 * several kernels (RMSNorm alone: pow, mean, add, rsqrt, two muls) with an allocation and a dispatch each,
 * which for a decode step's few rows costs more than the arithmetic.
 *
 * Arithmetic follows HF transformers' Llama: RMSNorm as w * (x * rsqrt(mean(x^2) + eps)), SiLU as
 * x / (1 + exp(-x)), rotary as x * cos + rotate_half(x) * sin. Sums run in a different order than torch's,
 * so results agree to float32 rounding, not bit for bit.
 */
#include <math.h>

#include "cb_simd.h"
#if CB_VW >= 8
#include <immintrin.h>
#endif

#define CB_PARALLEL_MIN 32768 /* elements below which one thread does the whole op */
#define CB_SILU_CHUNK 256

/* residual (optional): r = x + r is written back into residual and normalised; otherwise x is.
 * out[i] = w * (r[i] / sqrt(mean(r^2) + eps)). All rows have h elements. */
int cb_add_rms_norm_f32(const float *x, int64_t ldx, float *residual, int64_t ldr, const float *w, float eps,
                        float *out, int64_t ldo, int m, int h) {
    if (m < 0 || h < 1 || ldx < h || ldo < h || (residual && ldr < h)) return CB_EINVAL;
#pragma omp parallel for schedule(static) if ((int64_t)m * h >= CB_PARALLEL_MIN)
    for (int row = 0; row < m; ++row) {
        const float *xr = x + (int64_t)row * ldx;
        float *o = out + (int64_t)row * ldo;
        const float *src = xr;
        if (residual) {
            float *r = residual + (int64_t)row * ldr;
#pragma omp simd
            for (int i = 0; i < h; ++i) r[i] += xr[i];
            src = r;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < h; ++i) ss += src[i] * src[i];
        const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma omp simd
        for (int i = 0; i < h; ++i) o[i] = w[i] * (src[i] * inv);
    }
    return CB_OK;
}

/* x: [m, 2 * inter] = [gate | up] per row -> out: [m, inter] = silu(gate) * up. */
int cb_silu_mul_f32(const float *x, int64_t ldx, int m, int inter, float *out, int64_t ldo) {
    if (m < 0 || inter < 1 || ldx < 2 * (int64_t)inter || ldo < inter) return CB_EINVAL;
#pragma omp parallel for schedule(static) if ((int64_t)m * inter >= CB_PARALLEL_MIN)
    for (int row = 0; row < m; ++row) {
        const float *g = x + (int64_t)row * ldx, *u = g + inter;
        float *o = out + (int64_t)row * ldo;
        /* exp first, into a small buffer, then the division: as one loop GCC vectorised it with two divisions
         * a vector and ran at 3.3 cycles a value; as two, 1.4 (12 x 1536 values, Zen 4) */
        for (int i0 = 0; i0 < inter; i0 += CB_SILU_CHUNK) {
            const int n = inter - i0 < CB_SILU_CHUNK ? inter - i0 : CB_SILU_CHUNK;
            float e[CB_SILU_CHUNK];
#pragma omp simd
            for (int i = 0; i < n; ++i) e[i] = cb_exp(-g[i0 + i]);
#pragma omp simd
            for (int i = 0; i < n; ++i) o[i0 + i] = g[i0 + i] / (1.0f + e[i]) * u[i0 + i];
        }
    }
    return CB_OK;
}

/* x: [m, 2 * inter] = [gate | up] per row -> out: [m, inter] = gelu_tanh(gate) * up. GELU's tanh form as the
 * logistic function it is, 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)) with u = sqrt(2 / pi) (g + 0.044715 g^3):
 * vectorised like SiLU (libm's tanhf is a call per value), and accurate where 1 + tanh(u) is tiny. */
int cb_gelu_tanh_mul_f32(const float *x, int64_t ldx, int m, int inter, float *out, int64_t ldo) {
    if (m < 0 || inter < 1 || ldx < 2 * (int64_t)inter || ldo < inter) return CB_EINVAL;
    const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2 / pi), as torch's kBeta */
#pragma omp parallel for schedule(static) if ((int64_t)m * inter >= CB_PARALLEL_MIN)
    for (int row = 0; row < m; ++row) {
        const float *g = x + (int64_t)row * ldx, *u = g + inter;
        float *o = out + (int64_t)row * ldo;
        for (int i0 = 0; i0 < inter; i0 += CB_SILU_CHUNK) {
            const int n = inter - i0 < CB_SILU_CHUNK ? inter - i0 : CB_SILU_CHUNK;
            float e[CB_SILU_CHUNK];
#pragma omp simd
            for (int i = 0; i < n; ++i) {
                const float v = g[i0 + i];
                e[i] = cb_exp(-2.0f * k0 * (v + k1 * v * v * v));
            }
#pragma omp simd
            for (int i = 0; i < n; ++i) o[i0 + i] = g[i0 + i] / (1.0f + e[i]) * u[i0 + i];
        }
    }
    return CB_OK;
}

/* In place, rotate-half convention: x holds m rows (ldx floats apart) of `heads` vectors of head_dim floats;
 * row t is rotated by position pos[t] with cos/sin tables [max_pos, head_dim]. */
int cb_rotary_f32(float *x, int64_t ldx, int m, int heads, int head_dim, const int64_t *pos, const float *cos_t,
                  const float *sin_t, int64_t max_pos) {
    if (m < 0 || heads < 1 || head_dim < 2 || head_dim % 2 || ldx < (int64_t)heads * head_dim) return CB_EINVAL;
    for (int row = 0; row < m; ++row)
        if (pos[row] < 0 || pos[row] >= max_pos) return CB_ERANGE;
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if ((int64_t)m * heads * head_dim >= CB_PARALLEL_MIN)
    for (int row = 0; row < m; ++row) {
        const float *c = cos_t + pos[row] * head_dim, *s = sin_t + pos[row] * head_dim;
        for (int hd = 0; hd < heads; ++hd) {
            float *v = x + (int64_t)row * ldx + (int64_t)hd * head_dim;
#pragma omp simd
            for (int i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return CB_OK;
}

/* Structured output's token mask: in row r of logits (ld floats apart), token t is set to -inf unless bit
 * t % 32 of word t / 32 of row r of mask (mask_ld words apart) is 1 (xgrammar's bitmask layout). Words of all
 * ones, the common case outside a grammar's structural states, are skipped. */
int cb_apply_token_bitmask_f32(float *logits, int64_t ld, int rows, int vocab, const int32_t *mask, int64_t mask_ld) {
    const int words = (vocab + 31) / 32;
    if (rows < 0 || vocab < 1 || ld < vocab || mask_ld < words) return CB_EINVAL;
    for (int r = 0; r < rows; ++r) {
        float *row = logits + (int64_t)r * ld;
        const uint32_t *bits = (const uint32_t *)mask + (int64_t)r * mask_ld;
        for (int w = 0; w < words; ++w) {
            const int n = vocab - 32 * w < 32 ? vocab - 32 * w : 32;
            const uint32_t keep = bits[w] | (n < 32 ? ~0u << n : 0u); /* tokens past vocab stay untouched */
            if (keep == ~0u) continue;
#if CB_VW == 16
            const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
            _mm512_mask_storeu_ps(row + 32 * w, (__mmask16)~keep, neg_inf);
            _mm512_mask_storeu_ps(row + 32 * w + 16, (__mmask16)(~keep >> 16), neg_inf);
#elif CB_VW == 8 /* lane b of group g written where bit 8g + b of ~keep is set (masked lanes are not touched) */
            const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            for (int g = 0; g < 4; ++g) {
                const __m256i drop = _mm256_and_si256(_mm256_set1_epi32((int)(~keep >> 8 * g)), lane_bit);
                _mm256_maskstore_ps(row + 32 * w + 8 * g, _mm256_cmpeq_epi32(drop, lane_bit), _mm256_set1_ps(-INFINITY));
            }
#else
            for (int b = 0; b < n; ++b)
                if (!(keep >> b & 1u)) row[32 * w + b] = -INFINITY;
#endif
        }
    }
    return CB_OK;
}
