/* Internal helpers of cbserve's CPU kernels (attention.c, gemm.c, elementwise.c, panels.c, layers.c, lora.c): vector
 * types, loads and stores, a vectorisable exp. Nothing here is exported; the ABI is cb_cpu.h, included below.
 * Everything is float32.
 *
 * The library is built once per ISA level (../native.py): AVX-512 (-march=native on an AVX-512 CPU, or
 * x86-64-v4), AVX2 + FMA (x86-64-v3) and scalar (no ISA-specific code: portable C for baseline x86-64 or any
 * other CPU). `vf` is one register of the level's width, CB_VW floats: 16 (zmm), 8 (ymm) or 4 (what the
 * portable path's GCC vectors lower to). Kernels are written in vf and CB_VW and block their work for the
 * level's register file (CB_VREGS), so that no value is wider than a register: a 64-byte vector on AVX2 is
 * two ymm values the compiler keeps on the stack (2 GFLOP/s linear layers), not in registers.
 */
#ifndef CB_SIMD_H
#define CB_SIMD_H

#include <stdint.h>
#include <string.h>

#include "cb_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CB_VW 16
#define CB_VREGS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define CB_VW 8
#define CB_VREGS 16
#else
#define CB_VW 4
#define CB_VREGS 16
#endif
/* int16 pairs multiplied and added in one instruction at the level's width (CB_ISA_I16_DOT) */
#if (CB_VW == 16 && defined(__AVX512VNNI__)) || (CB_VW == 8 && defined(__AVXVNNI__))
#define CB_I16_DOT 1
#else
#define CB_I16_DOT 0
#endif

typedef float vf __attribute__((vector_size(CB_VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(CB_VW * 4), aligned(4)));

static inline vf cb_load(const float *p) { return *(const vf *)p; }
static inline void cb_store(float *p, vf v) { *(vf *)p = v; }

/* 16-wide vectors, for the AVX-512-only paths (bfloat16 products, AMX). */
#ifdef __AVX512F__
typedef float vf16 __attribute__((vector_size(64), aligned(4)));
static inline vf16 cb_load16(const float *p) { return *(const vf16 *)p; }
#endif

static inline int cb_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Work items [0, items) shared so that a preempted thread does not hold the others up. Each thread owns a
 * contiguous share (the static schedule's: the same items, in the same order, on a quiet machine) and takes
 * items from its front; a thread whose share is done takes the last items of the others' shares, one at a
 * time. On a machine the engine shares with a server's other processes, a thread the kernel preempts
 * mid-region no longer leaves its partner to wait at the region's end for the whole rest of its share, only
 * for the item it holds. A share is (front, back) in one 64-bit word: the owner's fetch-add moves the front,
 * a thief's compare-and-swap the back, so each item is taken exactly once. Every item writes outputs of its
 * own, so which thread runs it changes no result. */
#define CB_MAX_SHARES 256 /* threads with a share of their own (16 KB of stack); more only take others' items */

typedef struct {
    uint64_t range __attribute__((aligned(64))); /* front (low 32 bits), back (high 32 bits) */
} cb_share_t;

/* Before the parallel region: one share per thread the region may have; returns how many. */
static inline int cb_shares_init(cb_share_t *shares, int items) {
    int n = cb_max_threads();
    n = n < 1 ? 1 : (n > CB_MAX_SHARES ? CB_MAX_SHARES : n);
    for (int t = 0; t < n; ++t) {
        const uint64_t lo = (uint64_t)((int64_t)items * t / n), hi = (uint64_t)((int64_t)items * (t + 1) / n);
        shares[t].range = hi << 32 | lo;
    }
    return n;
}

/* Inside the region: the calling thread's next item, or -1 when none is left anywhere. */
static inline int cb_share_next(cb_share_t *shares, int nshares) {
#ifdef _OPENMP
    const int me = omp_get_thread_num();
#else
    const int me = 0;
#endif
    if (me < nshares) {
        const uint64_t r = __atomic_fetch_add(&shares[me].range, 1, __ATOMIC_RELAXED);
        if ((uint32_t)r < (uint32_t)(r >> 32)) return (int)(uint32_t)r;
    }
    for (int v = 1; v <= nshares; ++v) { /* every other share (all of them for a thread beyond the shares) */
        if ((me + v) % nshares == me) continue;
        cb_share_t *other = &shares[(me + v) % nshares];
        uint64_t r = __atomic_load_n(&other->range, __ATOMIC_RELAXED);
        while ((uint32_t)r < (uint32_t)(r >> 32))
            if (__atomic_compare_exchange_n(&other->range, &r, r - (1ull << 32), 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                return (int)(r >> 32) - 1;
    }
    return -1;
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

/* The float32 value of float16 bits h (exact; the GGUF block scales). */
static inline float cb_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits = sign;
    if (exp == 0x1F)
        bits |= 0x7F800000u | man << 13;
    else if (exp)
        bits |= (exp + 112) << 23 | man << 13;
    else if (man) { /* subnormal: man * 2^-24, a float32 normal */
        const float f = (float)man * 0x1p-24f;
        uint32_t mag;
        memcpy(&mag, &f, 4);
        bits |= mag;
    }
    float r;
    memcpy(&r, &bits, 4);
    return r;
}

/* The float16 bits of x into *h when x is a float16 value exactly (finite); 0 when it is not (nothing written). */
static inline int cb_float_to_half_exact(float x, uint16_t *h) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    const uint16_t sign = (uint16_t)(bits >> 16 & 0x8000u);
    const uint32_t mag = bits & 0x7FFFFFFFu;
    const int e = (int)(mag >> 23) - 127;
    uint16_t out;
    if (mag == 0)
        out = sign;
    else if (e >= -14 && e <= 15 && !(mag & 0x1FFFu)) /* normal: 10 significand bits */
        out = (uint16_t)(sign | (uint32_t)(e + 15) << 10 | (mag & 0x7FFFFFu) >> 13);
    else if (e >= -24 && e < -14) { /* subnormal: an integer multiple of 2^-24 below 2^-14 */
        const float scaled = (x < 0 ? -x : x) * 0x1p24f;
        const uint32_t m = (uint32_t)scaled;
        if ((float)m != scaled) return 0;
        out = (uint16_t)(sign | m);
    } else
        return 0;
    *h = out;
    return 1;
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
