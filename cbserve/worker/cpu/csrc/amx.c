/* bfloat16 products on Intel AMX tiles (gemm.c's cb_linear_bf16_dot hands over blocks of >= CB_AMX_MIN_ROWS
 * rows where the CPU, the compiler and the kernel allow it).
 *
 * The same arithmetic as the AVX-512 BF16 path: A's rows and the (decoded) weights rounded to bfloat16 to
 * nearest even, products summed in float32 from the bias (or zero). TDPBF16PS adds the 32 products of a
 * 16-pair k step to each float32 sum at once where vdpbf16ps adds two at a time, so the sums agree within
 * float32 rounding, not bit for bit. The weights' panels are already in the layout the tile instruction
 * reads: [k / 2][48][2] bfloat16 pairs (cb_panel_pairs) is three B tiles of 16 columns side by side, 192 bytes
 * a k pair. A work item is one 48-column panel and up to CB_AMX_ROW_BLOCK rows; it walks k in chunks of
 * CB_AMX_KC decoded once, and every 16 rows of the item multiply the chunk (3 C tiles, 1 A tile, 3 B tiles).
 *
 * Linux gives a process the AMX tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM, kernel 5.16+):
 * cb_amx_ready() asks once; where it is refused, or the kernels were built without AMX, the caller keeps the
 * AVX-512 path. cb_set_amx() turns the path off and on (tests compare both).
 */
#include <stdlib.h>
#include <string.h>

#include "panels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CB_AMX_KC 256        /* k values a chunk: 24 KB of decoded pairs */
#define CB_AMX_ROW_BLOCK 256 /* rows a work item covers at most (its float32 partial sums: 48 KB) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cb_tilecfg_t;

/* 0: not asked yet, 1: granted, 2: refused; the user's switch, on unless turned off. */
static int amx_state;
static int amx_enabled = 1;

static int amx_granted(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 2;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

int cb_amx_ready(void) { return __atomic_load_n(&amx_enabled, __ATOMIC_RELAXED) && amx_granted(); }

int cb_set_amx(int enable) {
    __atomic_store_n(&amx_enabled, enable != 0, __ATOMIC_RELAXED);
    return enable ? amx_granted() : 0;
}

/* tmm0-2: C (16 rows x 16 float32), tmm3: A (16 rows x 16 pairs), tmm4-6: B (16 pairs x 16 columns). */
static void configure_tiles(void) {
    cb_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 7; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* 16 rows of C += a (the rows' A tiles, 1 KB each, k order) against kn pairs of w ([kn][48][2]); the sums are
 * read from acc ([16][48] float32) and written to out, ldo floats a row (acc itself, or C). */
static inline void block16(const uint32_t *a, const uint16_t *w, int kn, const float *acc, float *out, int64_t ldo) {
    _tile_loadd(0, acc, CB_NR * 4);
    _tile_loadd(1, acc + 16, CB_NR * 4);
    _tile_loadd(2, acc + 32, CB_NR * 4);
    for (int kk = 0; kk < kn; kk += 16) {
        _tile_loadd(3, a + (int64_t)kk * 16, 64);
        const uint16_t *wk = w + (int64_t)kk * 2 * CB_NR;
        _tile_loadd(4, wk, CB_NR * 4);
        _tile_loadd(5, wk + 32, CB_NR * 4);
        _tile_loadd(6, wk + 64, CB_NR * 4);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + 16, ldo * 4);
    _tile_stored(2, out + 32, ldo * 4);
}

/* One work item: rows (padded to 16 in a and in accbuf) of a (A tiles, kp / 16 a row block) against one panel of
 * kp pairs. The last chunk's full blocks (16 rows, 48 columns) are stored straight into C; the others go
 * through accbuf. */
static void panel_rows_amx(int fmt, const uint32_t *a, int rows, int kp, const uint8_t *panel, const float *bias,
                           float *c, int64_t ldc, int ncols, uint16_t *pairs, float *accbuf) {
    const int blocks = (rows + 15) / 16;
    for (int i = 0; i < blocks * 16; ++i) {
        if (bias) memcpy(accbuf + i * CB_NR, bias, sizeof(float) * CB_NR);
        else memset(accbuf + i * CB_NR, 0, sizeof(float) * CB_NR);
    }
    int direct = 0; /* blocks of the last chunk stored into C */
    for (int k0 = 0; k0 < kp; k0 += CB_AMX_KC / 2) {
        const int kn = kp - k0 < CB_AMX_KC / 2 ? kp - k0 : CB_AMX_KC / 2, last = k0 + kn == kp;
        const uint16_t *w = cb_panel_pairs(fmt, panel, 2 * k0, 2 * kn, pairs);
        for (int b = 0; b < blocks; ++b) {
            float *acc = accbuf + b * 16 * CB_NR;
            const int to_c = last && ncols == CB_NR && (b + 1) * 16 <= rows;
            block16(a + ((int64_t)b * kp + k0) * 16, w, kn, acc, to_c ? c + (int64_t)b * 16 * ldc : acc,
                    to_c ? ldc : CB_NR);
            direct += to_c;
        }
    }
    for (int i = direct * 16; i < rows; ++i)
        memcpy(c + (int64_t)i * ldc, accbuf + i * CB_NR, sizeof(float) * (size_t)ncols);
}

static inline const float *panel_bias(const float *bias, int p, int ncols, float *tail) {
    if (!bias || ncols == CB_NR) return bias ? bias + p * CB_NR : NULL;
    memset(tail, 0, sizeof(float) * CB_NR);
    memcpy(tail, bias + p * CB_NR, sizeof(float) * (size_t)ncols);
    return tail;
}

int cb_linear_amx(int fmt, const uint32_t *ab, int64_t kp, int m, const uint8_t *wp, int64_t pbytes, int n,
                  const float *bias, float *c, int64_t ldc) {
    const int panels = (n + CB_NR - 1) / CB_NR, row_blocks = (m + CB_AMX_ROW_BLOCK - 1) / CB_AMX_ROW_BLOCK;
    const int block_rows = (m < CB_AMX_ROW_BLOCK ? (m + 15) / 16 * 16 : CB_AMX_ROW_BLOCK);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *accbuf = aligned_alloc(64, sizeof(float) * (size_t)block_rows * CB_NR);
        uint16_t pairs[CB_AMX_KC * CB_NR] __attribute__((aligned(64)));
        failed = accbuf == NULL;
        if (accbuf) configure_tiles();
#pragma omp for schedule(static)
        for (int item = 0; item < panels * row_blocks; ++item) {
            const int p = item % panels, r0 = (item / panels) * CB_AMX_ROW_BLOCK; /* a row block stays in L2 */
            const int rows = m - r0 < CB_AMX_ROW_BLOCK ? m - r0 : CB_AMX_ROW_BLOCK;
            const int ncols = n - p * CB_NR < CB_NR ? n - p * CB_NR : CB_NR;
            float tail_bias[CB_NR];
            if (accbuf) panel_rows_amx(fmt, ab + (int64_t)r0 * kp, rows, (int)kp, wp + p * pbytes,
                                       panel_bias(bias, p, ncols, tail_bias), c + (int64_t)r0 * ldc + p * CB_NR, ldc,
                                       ncols, pairs, accbuf);
        }
        if (accbuf) _tile_release();
        free(accbuf);
    }
    return failed ? CB_ENOMEM : CB_OK;
}

#else /* no AMX in this build */

int cb_amx_ready(void) { return 0; }
int cb_set_amx(int enable) { (void)enable; return 0; }
int cb_linear_amx(int fmt, const uint32_t *ab, int64_t kp, int m, const uint8_t *wp, int64_t pbytes, int n,
                  const float *bias, float *c, int64_t ldc) {
    (void)fmt, (void)ab, (void)kp, (void)m, (void)wp, (void)pbytes, (void)n, (void)bias, (void)c, (void)ldc;
    return CB_EINVAL;
}

#endif
