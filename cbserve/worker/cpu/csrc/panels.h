/* Packed weight layouts of cbserve's linear kernel (gemm.c), shared with their packers (panels.c). Internal:
 * the formats' numbers and the exported packers are in cb_cpu.h.
 *
 * Every layout cuts W [n, k] into panels of CB_NR = 48 output columns (the last one zero-padded); a panel
 * holds, for each k, the 48 weights W[48p .. 48p+47, k]. The formats differ in how those weights are stored:
 *
 *   CB_FMT_F32   4 bytes a weight:   [k][48] float.
 *   CB_FMT_BF16  2 bytes a weight:   [k][48] the upper halves of float32 values whose lower halves are zero
 *                                    (what a bfloat16 checkpoint loaded as float32 holds).
 *   CB_FMT_Q8_0  1.0625 bytes:       blocks of CB_QK = 32 k values: float16 d[48], int8 q[32][48];
 *                                    w = d * q (GGUF Q8_0, whose bytes per weight it keeps).
 *   CB_FMT_Q4_1  0.625 bytes:        blocks of 32 k values: float16 d[48], float16 m[48], uint8 q[16][48]
 *                                    where byte [j][c] holds k = 2j in its low nibble and k = 2j + 1 in its
 *                                    high one; w = d * q + m (GGUF Q4_1).
 *   CB_FMT_Q4_0  0.5625 bytes:       blocks of 32 k values: float16 d[48], uint8 q[16][48] as Q4_1's;
 *                                    w = d * (q - 8) (GGUF Q4_0).
 *   CB_FMT_BF16_DOT  2 bytes:        [ceil(k / 2)][48][2] bfloat16: the k pair (2j, 2j + 1) of each column
 *                                    side by side (a zero pads an odd k), each value rounded to nearest
 *                                    even; what AVX-512 BF16's pairwise dot product reads. Lossy: the
 *                                    one format whose values are not the checkpoint's (dtype bfloat16).
 *   CB_FMT_Q4_K  0.578 bytes:        super-blocks of CB_QKK = 256 k values: float16 d[48], float16 dmin[48], then 8
 *                                    blocks of 32: uint8 sc[48], uint8 m[48] (6 bits each), uint8 q[16][48] as
 *                                    Q4_1's; w = d * sc * q - dmin * m (GGUF Q4_K, its scales unpacked).
 *   CB_FMT_Q5_0  0.6875 bytes:       blocks of 32: float16 d[48], uint8 q[16][48] as Q4_1's, uint8 qh[4][48] as
 *                                    Q5_K's; w = d * (q - 16) (GGUF Q5_0, its bytes per weight).
 *   CB_FMT_Q5_K  0.703 bytes:        Q4_K's, each block followed by uint8 qh[4][48]: the fifth bit of k = 8i + t at
 *                                    bit t of byte [i] (GGUF Q5_K, values 0..31).
 *   CB_FMT_Q6_K  0.820 bytes:        super-blocks of 256: float16 d[48], then 8 blocks of 32: int8 sc[2][48] (k
 *                                    0-15, 16-31), uint8 ql[16][48] (the low 4 bits of q as Q4_1's nibbles),
 *                                    uint8 qh[8][48] (the high 2 bits of k = 4i + t at bits 2t of byte [i]);
 *                                    w = d * sc * (q - 32) (GGUF Q6_K, its bytes per weight).
 *   CB_FMT_Q8_0_BF16, CB_FMT_Q4_1_BF16, CB_FMT_Q4_0_BF16: the bytes of CB_FMT_Q8_0 / CB_FMT_Q4_1 /
 *                                    CB_FMT_Q4_0, each decoded value rounded to bfloat16 (for bfloat16
 *                                    products: the GGUF blocks stay compact).
 *   fmt | CB_FMT_I16 (fmt Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K): fmt's size, scales and values, each block's
 *                                    q[16][48] regrouped as uint32 q[4][48] (dword g of a column: k = 8g + 2p
 *                                    at bits 4p, k = 8g + 2p + 1 at bits 16 + 4p), Q5's qh[4][48] as uint32
 *                                    qh[48] (k = 2m at bit m, 2m + 1 at bit 16 + m), Q6_K's qh[8][48] as uint32
 *                                    qh[2][48] (k = 16h + 2m at bits 2m, + 1 at 16 + 2m): each k pair one
 *                                    shift and mask from a dword as two int16 (i16.h; packed by cb_repack_i16,
 *                                    few-row products on int16 rows in rows_i16.c).
 *
 * Every other format decodes to the float32 values the dense checkpoint holds: the GGUF scales are float16
 * values, kept as such (the K-quants' 6- and 8-bit sub-scales as integers), so d * q and d * (q - 8) are exact in float32 and d * q + m is rounded once, as gguf-py's
 * dequantization (and so transformers) rounds it: bit for bit. The Python side checks this for every weight
 * before it uses a packing.
 */
#ifndef CB_PANELS_H
#define CB_PANELS_H

#include <string.h>

#include "cb_cpu.h"

#define CB_NR 48
#define CB_QK 32

/* The format whose bytes fmt reads (CB_FMT_Q8_0 for CB_FMT_Q8_0_BF16, ...; a CB_FMT_I16 variant's bytes are its
 * own), and whether its products are bfloat16. */
int cb_storage_format(int fmt);
/* The base formats that have a CB_FMT_I16 variant (its layout: i16.h). */
static inline int cb_i16_format(int fmt) {
    return fmt == CB_FMT_Q4_0 || fmt == CB_FMT_Q4_1 || fmt == CB_FMT_Q5_0 || fmt == CB_FMT_Q4_K || fmt == CB_FMT_Q5_K ||
           fmt == CB_FMT_Q6_K || fmt == CB_FMT_Q8_0;
}
static inline int cb_bf16_products(int fmt) {
    return fmt == CB_FMT_BF16_DOT || fmt == CB_FMT_Q8_0_BF16 || fmt == CB_FMT_Q4_1_BF16 || fmt == CB_FMT_Q4_0_BF16;
}
/* GGUF blocks decoded for bfloat16 products (the one-row path of gemm.c decodes them in registers). */
static inline int cb_bf16_blocks(int fmt) {
    return fmt == CB_FMT_Q8_0_BF16 || fmt == CB_FMT_Q4_1_BF16 || fmt == CB_FMT_Q4_0_BF16;
}

/* Bytes of one panel of k rows in format fmt; -1 for an unknown format or a k the format cannot hold. */
int64_t cb_panel_bytes(int fmt, int k);

/* The weights of k values [k0, k0 + kn) of one panel as float32 [kn][48]: a pointer into the panel itself
 * (CB_FMT_F32) or into scratch, which must hold kn * 48 floats (rounded up to even). k0 and kn are multiples
 * of CB_QK for the block formats and even for CB_FMT_BF16_DOT (kn may end at k). */
const float *cb_panel_chunk(int fmt, const uint8_t *panel, int k0, int kn, float *scratch);

/* The K-quants and Q5_0 (kquants.c): bytes of one panel (-1 unless k is a multiple of 256, of 32 for Q5_0), and
 * cb_panel_chunk's decoding. */
int64_t cb_kquant_panel_bytes(int fmt, int k);
const float *cb_kquant_chunk(int fmt, const uint8_t *panel, int k0, int kn, float *scratch);
static inline int cb_kquant(int fmt) {
    return fmt == CB_FMT_Q4_K || fmt == CB_FMT_Q5_K || fmt == CB_FMT_Q6_K || fmt == CB_FMT_Q5_0;
}

/* The bias of panel p (NULL without one); the last panel's zero-padded into tail (the kernels read 48 at a time). */
static inline const float *cb_item_bias(const float *bias, int p, int ncols, float *tail) {
    if (!bias || ncols == CB_NR) return bias ? bias + p * CB_NR : NULL;
    memset(tail, 0, sizeof(float) * CB_NR);
    memcpy(tail, bias + p * CB_NR, sizeof(float) * (size_t)ncols);
    return tail;
}

/* Few-row products straight from the packed weights (rows.c): cb_rows_take says whether cb_linear_rows takes
 * (fmt, m, k): a float32-products format and a few rows (decode steps); cb_linear_rows is then cb_linear's
 * product, bit for bit. */
#define CB_ROWS_MAX 4 /* the most rows any level's few-row path takes */
int cb_rows_take(int fmt, int m, int k);
void cb_linear_rows(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n, const float *bias,
                    float *c, int64_t ldc);
/* Their loop over the panels (shared as gemm.c shares them): each panel meets the m rows in tiles of at most ``tile``
 * (<= CB_ROWS_MAX) while it stays in cache; each tile's sums start from the bias, panel_fn adds the products of rows
 * [row0, row0 + mr) ([mr][48] in acc_io; rows: the path's own form of the m rows), and the columns that exist go to
 * c. */
typedef void (*cb_rows_panel_fn)(int mr, int fmt, const void *rows, int row0, const uint8_t *panel, float *acc_io);
void cb_rows_over_panels(int fmt, int m, int k, const uint8_t *wp, int n, const float *bias, float *c, int64_t ldc,
                         cb_rows_panel_fn panel_fn, const void *rows, int tile);

/* The CB_FMT_I16 variants' few-row products (rows_i16.c): whether cb_linear_rows_i16 takes (fmt, m, k), and the
 * product (CB_ENOMEM when the rounded rows find no memory). */
int cb_rows_i16_take(int fmt, int m, int k);
int cb_linear_rows_i16(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                       const float *bias, float *c, int64_t ldc);

#ifdef __AVX512BF16__
/* The bfloat16 pairs of k values [k0, k0 + kn) of one panel of a bfloat16-products format, [kn / 2][48][2]: a
 * pointer into the panel itself (CB_FMT_BF16_DOT) or into scratch (kn * 48 values), decoded and rounded as
 * cb_panel_chunk rounds (but for denormals, which the instruction flushes to zero). k0, kn: as there. */
const uint16_t *cb_panel_pairs(int fmt, const uint8_t *panel, int k0, int kn, uint16_t *scratch);

/* One row against one panel of a cb_bf16_blocks format, the weights decoded and rounded as
 * cb_panel_pairs does but fed to vdpbf16ps from registers (a decode step's one-row products read each weight
 * once: no scratch round trip). a: the row's kp bfloat16 pairs (kp = k / 2, k a multiple of CB_QK); acc48:
 * the 48 column sums, in and out. Bit for bit what the tiled path computes (the same products added in the
 * same k order). */
void cb_blocks_row_dot(int fmt, const uint32_t *a, int kp, const uint8_t *panel, float *acc48);
#endif

/* AMX tiles (amx.c). cb_amx_ready: the kernels were built with AMX, the kernel granted the tile state, and
 * cb_set_amx did not turn them off. cb_linear_amx: c = ab @ W^T (+ bias) for a bfloat16-products format; ab:
 * m rows of kp bfloat16 pairs (kp a multiple of 16), zero rows after them up to a multiple of 16, stored as
 * 16-row x 16-pair tiles of 1 KB: tile (i / 16, j / 16) at ((i / 16) * kp / 16 + j / 16) * 256 pairs. */
int cb_amx_ready(void);
int cb_linear_amx(int fmt, const uint32_t *ab, int64_t kp, int m, const uint8_t *wp, int64_t pbytes, int n,
                  const float *bias, float *c, int64_t ldc);

#endif
