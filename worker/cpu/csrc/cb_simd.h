/* Internal helpers of cbserve's CPU kernels (attention.c, gemm.c, elementwise.c, panels.c, layers.c): vector
 * types, loads and stores, a vectorisable exp. Nothing here is exported; the ABI is cb_cpu.h, included below.
 * Everything is float32. Vectors are GCC vector extensions, so the same source compiles to AVX-512, AVX2
 * or SSE, whatever -march allows (../native.py builds with -march=native).
 */
#ifndef CB_SIMD_H
#define CB_SIMD_H

#include <stdint.h>
#include <string.h>

#include "cb_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float vf16 __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));

static inline vf16 cb_load16(const float *p) { return *(const vf16 *)p; }
static inline void cb_store16(float *p, vf16 v) { *(vf16 *)p = v; }

static inline float cb_hsum16(vf16 v) {
    const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline int cb_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* The bfloat16 nearest to x (ties to even), as its 16 bits; torch's float32 -> bfloat16 conversion for every
 * finite x (NaN is not expected here: weights and activations are checked finite upstream). */
static inline uint16_t cb_bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* x rounded to the nearest bfloat16, as a float32. */
static inline float cb_round_bf16(float x) {
    const uint32_t bits = (uint32_t)cb_bf16_bits(x) << 16;
    float r;
    memcpy(&r, &bits, 4);
    return r;
}

#define CB_LOG2E 1.44269504088896341f
#define CB_LN2_HI 0.693359375f
#define CB_LN2_LO (-2.12194440e-4f)

/* exp(x) for x in [-87, 88] (clamped outside; Cephes' polynomial, ~1e-7 relative error), written so that
 * loops over it vectorize. */
static inline float cb_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
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

#endif
