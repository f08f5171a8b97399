/* Sampling helpers for CPUs: the top-p (nucleus) cut of each row of probabilities without sorting the row.
 *
 * A row's nucleus is its most likely tokens, taken in descending order while the mass of the tokens before
 * them is below top_p (so the first is always kept). What the sampler needs is the least probability kept:
 * every token at or above it is kept (ties included), every token below it is masked. torch finds it by
 * sorting the row (117 ms for 64 rows of 49,152 tokens on the 2-core benchmark machine) or by a top-k that
 * grows with the nucleus. Here one pass adds each probability's mass (in double) to a bucket of its float
 * bits (exponent and 3 mantissa bits: values within a factor 1.09 share one), the buckets walked from the top
 * find the one where the nucleus ends, and a weighted quickselect over that bucket's values alone finds the
 * cut: two passes over the row whatever the nucleus size.
 */
#include <math.h>
#include <stdlib.h>

#include "cb_simd.h"

static inline void swap_f(float *a, float *b) {
    const float t = *a;
    *a = *b;
    *b = t;
}

static float median3(float a, float b, float c) {
    if (a > b) swap_f(&a, &b);
    if (b > c) swap_f(&b, &c);
    return a > b ? a : b;
}

/* Three-way partition of v[0, n) around pivot: [0, *gt) > pivot, [*gt, *eq) == pivot, [*eq, n) < pivot;
 * returns the mass of the first part and sets *eq_mass to the second's. */
static double partition3(float *v, int n, float pivot, int *gt, int *eq, double *eq_mass) {
    int lo = 0, i = 0, hi = n;
    double greater = 0.0, equal = 0.0;
    while (i < hi) {
        if (v[i] > pivot) {
            greater += v[i];
            swap_f(&v[i++], &v[lo++]);
        } else if (v[i] < pivot) {
            swap_f(&v[i], &v[--hi]);
        } else {
            equal += v[i++];
        }
    }
    *gt = lo;
    *eq = hi;
    *eq_mass = equal;
    return greater;
}

#define CB_TOP_P_SHIFT 20 /* a positive float's bits >> 20: 8 exponent + 3 mantissa bits */
#define CB_TOP_P_BUCKETS (1 << (31 - CB_TOP_P_SHIFT))

/* The least kept probability among v[0, n) (reordered, positive), given the mass `above` (< top_p) of the
 * kept tokens larger than all of them. */
static float nucleus_floor(float *v, int n, double above, double top_p) {
    for (;;) {
        const float pivot = median3(v[0], v[n / 2], v[n - 1]);
        int gt, eq;
        double eq_mass;
        const double greater = partition3(v, n, pivot, &gt, &eq, &eq_mass);
        if (above + greater >= top_p) { /* the nucleus ends above the pivot (gt > 0: above < top_p) */
            n = gt;
            continue;
        }
        above += greater + eq_mass; /* the pivot's tokens are kept */
        if (above >= top_p || eq == n) return pivot;
        v += eq; /* the nucleus reaches below the pivot */
        n -= eq;
    }
}

static inline uint32_t bucket_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return bits >> CB_TOP_P_SHIFT;
}

/* One row: p[0, vocab) non-negative, top_p < 1; buf: vocab floats, mass: CB_TOP_P_BUCKETS doubles. */
static float row_threshold(const float *p, int vocab, double top_p, float *buf, double *mass) {
    memset(mass, 0, sizeof(double) * CB_TOP_P_BUCKETS);
    for (int t = 0; t < vocab; ++t)
        if (p[t] > 0.0f) mass[bucket_of(p[t])] += p[t];
    double above = 0.0;
    int cut = CB_TOP_P_BUCKETS - 1;
    for (; cut >= 0 && above + mass[cut] < top_p; --cut) above += mass[cut];
    if (cut < 0) { /* the whole mass rounds below top_p: every positive token is kept */
        float least = 0.0f;
        for (int t = 0; t < vocab; ++t)
            if (p[t] > 0.0f && (least == 0.0f || p[t] < least)) least = p[t];
        return least;
    }
    int n = 0;
    for (int t = 0; t < vocab; ++t)
        if (p[t] > 0.0f && bucket_of(p[t]) == (uint32_t)cut) buf[n++] = p[t];
    return nucleus_floor(buf, n, above, top_p);
}

int cb_top_p_threshold_f32(const float *probs, int64_t ld, int rows, int vocab, const float *top_p,
                           float *threshold) {
    if (rows < 0 || vocab < 1 || ld < vocab) return CB_EINVAL;
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *buf = malloc(sizeof(float) * (size_t)vocab);
        double *mass = malloc(sizeof(double) * CB_TOP_P_BUCKETS);
        bad |= !buf || !mass;
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < rows; ++r) /* 0: the row kept whole */
            threshold[r] = buf && mass && top_p[r] < 1.0f
                               ? row_threshold(probs + (int64_t)r * ld, vocab, (double)top_p[r], buf, mass)
                               : 0.0f;
        free(buf);
        free(mass);
    }
    return bad ? CB_ENOMEM : CB_OK;
}

/* ---- greedy choice ---------------------------------------------------------------------------------- */

/* The index of the row's largest value, the first on ties (torch's argmax); the first NaN where there is one
 * (torch's max propagates NaN). One vectorised pass: each lane keeps its largest value and where it first
 * saw it (a later value replaces it only when greater), then the lanes' winner is the largest, at the least
 * index among equals. */
static int64_t row_argmax(const float *restrict x, int n) {
    float best = x[0];
    int64_t at = 0;
    int i = 0, nan = 0;
    if (n >= CB_VW) {
        vi lane, seen, nanv = (vi){0};
        for (int j = 0; j < CB_VW; ++j) lane[j] = j;
        vf m = cb_load(x);
        for (seen = lane; i + CB_VW <= n; i += CB_VW) {
            const vf v = cb_load(x + i);
            const vi gt = v > m;
            m = (vf)(((vi)v & gt) | ((vi)m & ~gt));
            seen = ((lane + i) & gt) | (seen & ~gt);
            nanv |= v != v;
        }
        best = m[0], at = seen[0];
        for (int j = 0; j < CB_VW; ++j) {
            if (m[j] > best || (m[j] == best && seen[j] < at)) best = m[j], at = seen[j];
            nan |= nanv[j];
        }
    }
    for (; i < n; ++i) {
        if (x[i] > best) best = x[i], at = i;
        nan |= x[i] != x[i];
    }
    for (i = 0; nan && i < n; ++i)
        if (x[i] != x[i]) return i;
    return at;
}

int cb_argmax_f32(const float *x, int64_t ld, int rows, int n, int64_t *out) {
    if (rows < 0 || n < 1 || ld < n) return CB_EINVAL;
    /* a row is ~10 us: threads only where there are rows enough to pay for waking them */
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int r = 0; r < rows; ++r) out[r] = row_argmax(x + (int64_t)r * ld, n);
    return CB_OK;
}
