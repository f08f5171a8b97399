/* The ABI of cbserve's CPU kernels: every function the library exports and every struct it takes, and
 * nothing else. The library is built with -fvisibility=hidden, so a function is exported exactly when it
 * is declared CB_API here; ../abi.py parses this file when it loads the library and refuses to bind
 * unless its ctypes table (functions, structs, formats and return codes) says the same. Every .c file
 * includes this header (through cb_simd.h), so the compiler checks each definition against it too.
 *
 * Everything is float32 unless a type says otherwise; a matrix is rows of contiguous values, `ld*` floats
 * apart. Return codes of every function returning int: CB_OK or one of the errors below.
 */
#ifndef CB_CPU_H
#define CB_CPU_H

#include <stdint.h>

#define CB_API __attribute__((visibility("default")))

enum { CB_OK = 0, CB_ENOMEM = 1, CB_EINVAL = 2, CB_ERANGE = 3 };

/* Packed weight formats (layouts in panels.h). */
enum {
    CB_FMT_F32 = 0,
    CB_FMT_BF16 = 1,
    CB_FMT_Q8_0 = 2,
    CB_FMT_Q4_1 = 3,
    CB_FMT_BF16_DOT = 4,  /* bfloat16 products from here on (see cb_linear) */
    CB_FMT_Q8_0_BF16 = 5, /* CB_FMT_Q8_0's bytes, each decoded weight rounded to bfloat16 */
    CB_FMT_Q4_1_BF16 = 6, /* CB_FMT_Q4_1's bytes, likewise */
    CB_FMT_Q4_0 = 7,
    CB_FMT_Q4_0_BF16 = 8, /* CB_FMT_Q4_0's bytes, each decoded weight rounded to bfloat16 */
    CB_FMT_Q4_K = 9,      /* GGUF's K-quants (kquants.c), float32 products */
    CB_FMT_Q6_K = 10,
    CB_FMT_Q5_K = 11,
    CB_FMT_Q5_0 = 12,
    CB_FMT_COUNT = 13,
    CB_FMT_I16 = 256, /* a flag or'ed into CB_FMT_Q4_0, Q4_1, Q5_0, Q4_K, Q5_K or Q6_K: the same weights and size, the
                         values' bits regrouped as int16 pairs (cb_repack_i16), few-row products with the rows rounded
                         to int16 (see cb_linear) */
    CB_FMT_I16ALL = 768 /* CB_FMT_I16 and one more bit (the same layout): every step's rows rounded to int16, not only
                           a few rows' (see cb_linear) */
};

/* One packed linear layer: out [m, n] = a [m, k] W^T (+ bias). */
typedef struct {
    int fmt;            /* CB_FMT_* */
    const uint8_t *w;   /* packed weight */
    int n, k;           /* W is [n, k] */
    const float *bias;  /* [n] or NULL */
    int bias_in_kernel; /* 1: the product starts from the bias (column-parallel); 0: added after it */
    int split;          /* with rest: the rows [0, split) fmt and w hold; rows [split, n) are rest's */
    const void *rest;   /* NULL, or the cb_lin_t of the rows after split (its n: n - split; its k: k), in its
                           own format: a fused weight whose GGUF parts are of different block types */
} cb_lin_t;

/* One decoder layer's weights and KV cache. */
typedef struct {
    const float *in_norm, *post_norm; /* [hidden] */
    cb_lin_t qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [num_blocks, block_size, kv_heads, head_dim] */
    int window;               /* > 0: the layer's sliding window (the last `window` keys); 0: none */
    const float *q_norm, *k_norm; /* [head_dim]: RMSNorm of each q and k head before the rotary (Qwen3); or NULL */
    const float *pre_ff_norm, *post_ff_norm; /* [hidden], Gemma: post_norm then norms the attention output alone,
                                                 these the MLP's input and output; both NULL: Llama's layer */
    float softcap;          /* > 0: attention logits capped to softcap * tanh(s / softcap) */
    const float *cos, *sin; /* this layer's rotary tables [max_pos, head_dim]; NULL: the model's */
} cb_layer_t;

/* The shapes every layer shares, and the rotary tables. */
typedef struct {
    int num_layers, hidden, heads, kv_heads, head_dim, inter;
    int num_blocks, block_size;
    float eps, scale;
    const float *cos, *sin; /* [max_pos, head_dim] */
    int64_t max_pos;
    int act; /* the gated MLP's activation: 0 SiLU, 1 GELU (tanh approximation) */
} cb_model_t;

/* ---- the build (gemm.c) --------------------------------------------------------------------------------- */

/* What the library was compiled for (one build per ISA level, see ../native.py): CB_ISA_* bits, none for the
 * scalar (portable) build. The loader checks them against the level it asked for. */
enum { CB_ISA_AVX2 = 1, CB_ISA_AVX512 = 2, CB_ISA_AVX512_BF16 = 4, CB_ISA_AMX = 8, CB_ISA_I16_DOT = 16 };
/* CB_ISA_I16_DOT: int16 pairs multiplied and added in one instruction (AVX-512 VNNI, or AVX-VNNI in an AVX2 build):
 * only then do the CB_FMT_I16ALL formats round many rows to int16 (two instructions lose to float32 products). */
CB_API int cb_isa_features(void);

/* ---- packed weights (panels.c) ------------------------------------------------------------------------- */

/* Bytes of W [n, k] packed as fmt; -1 for an unknown format or a k the format cannot hold. */
CB_API int64_t cb_packed_bytes(int fmt, int n, int k);
/* Output columns per panel (48). */
CB_API int cb_gemm_panel_width(void);
/* w: [n, k] rows ldw floats apart -> out: cb_packed_bytes(CB_FMT_F32, n, k) bytes. */
CB_API int cb_pack_weight_f32(const float *w, int64_t ldw, int n, int k, float *out);
/* As cb_pack_weight_f32, keeping the upper 16 bits of each value (the caller checked the lower 16 are zero). */
CB_API int cb_pack_weight_bf16(const float *w, int64_t ldw, int n, int k, uint16_t *out);
/* As cb_pack_weight_f32, each value rounded to bfloat16 (to nearest, ties to even) and stored in k pairs: the
 * CB_FMT_BF16_DOT layout, whose products cb_linear computes in bfloat16 (see there). */
CB_API int cb_pack_weight_bf16_dot(const float *w, int64_t ldw, int n, int k, uint16_t *out);
/* The GGUF block formats keep their float16 scales: each of d (and m) must be a float16 value (CB_ERANGE
 * otherwise, as for a 4-bit value above 15). */
/* d: [n, k / 32] scales; q: [n, k] int8 -> out: cb_packed_bytes(CB_FMT_Q8_0, n, k) bytes. */
CB_API int cb_pack_q8_0(const float *d, const int8_t *q, int n, int k, uint8_t *out);
/* d, m: [n, k / 32]; q: [n, k] uint8 values 0..15 -> out: cb_packed_bytes(CB_FMT_Q4_1, n, k) bytes. */
CB_API int cb_pack_q4_1(const float *d, const float *m, const uint8_t *q, int n, int k, uint8_t *out);
/* d: [n, k / 32]; q: [n, k] uint8 values 0..15 (w = d * (q - 8)) -> out: cb_packed_bytes(CB_FMT_Q4_0, n, k). */
CB_API int cb_pack_q4_0(const float *d, const uint8_t *q, int n, int k, uint8_t *out);
/* The K-quants (k a multiple of 256; super-block scales float16 values, CB_ERANGE otherwise or for a value out of
 * range). Q4_K: d, dmin [n, k / 256]; sc, m [n, k / 32] uint8 0..63; q [n, k] uint8 0..15: w = d sc q - dmin m. */
CB_API int cb_pack_q4_k(const float *d, const float *dmin, const uint8_t *sc, const uint8_t *m, const uint8_t *q, int n,
                        int k, uint8_t *out);
/* Q5_0 (k a multiple of 32, llama.cpp's fallback for rows that are not whole K-quant blocks): d [n, k / 32] float16
 * values; q [n, k] uint8 0..31: w = d (q - 16). */
CB_API int cb_pack_q5_0(const float *d, const uint8_t *q, int n, int k, uint8_t *out);
/* Q5_K: as Q4_K with q [n, k] uint8 0..31. */
CB_API int cb_pack_q5_k(const float *d, const float *dmin, const uint8_t *sc, const uint8_t *m, const uint8_t *q, int n,
                        int k, uint8_t *out);
/* Q6_K: d [n, k / 256]; sc [n, k / 16] int8; q [n, k] uint8 0..63: w = d sc (q - 32). */
CB_API int cb_pack_q6_k(const float *d, const int8_t *sc, const uint8_t *q, int n, int k, uint8_t *out);
/* packed (fmt, [n, k]) in CB_FMT_Q4_0, Q4_1, Q5_0, Q4_K, Q5_K or Q6_K -> out: the same panels in fmt | CB_FMT_I16's
 * layout (cb_packed_bytes(fmt, n, k) bytes; out may be packed itself, repacked in place). CB_EINVAL for another fmt. */
CB_API int cb_repack_i16(int fmt, const uint8_t *packed, int n, int k, uint8_t *out);
/* packed (fmt, [n, k]) -> out [n, k], rows ldo floats apart: what the linear kernel multiplies by. */
CB_API int cb_unpack_panels(int fmt, const uint8_t *packed, int n, int k, float *out, int64_t ldo);

/* ---- linear layers (gemm.c) ---------------------------------------------------------------------------- */

/* a: [m, k] rows lda floats apart; wp: W [n, k] packed as fmt; bias: [n] or NULL; c: [m, n] rows ldc apart.
 * CB_FMT_F32 .. CB_FMT_Q4_1 and CB_FMT_Q4_0 multiply in float32 by the weight's exact float32 values. The
 * bfloat16 formats (CB_FMT_BF16_DOT and the *_BF16 block formats) round each row of a and each (decoded) weight to
 * bfloat16 (to nearest even) and sum the products in float32, two k values a step (AVX-512 BF16's dot product
 * where the CPU has it; from 4 rows on, with k a multiple of 32, Intel AMX tiles where the CPU has them, 32 k
 * values a step): results within float32 rounding of bf16(a) @ bf16(W)^T computed in float32; they give
 * the same products for the same decoded weights. A CB_FMT_I16 variant (fmt | CB_FMT_I16) multiplies the same weights,
 * but a step of few rows (as the few-row path takes: 1-4 with AVX-512, 1-2 with AVX2) is rounded to int16 per 32 k
 * values (scale max|x| / 32767) and multiplied in integer pairs: within half a step per value of the float32 product;
 * more rows get the float32 products, unless it is a CB_FMT_I16ALL variant (fmt | CB_FMT_I16ALL) and the build has
 * CB_ISA_I16_DOT: then every row count is rounded so. */
CB_API int cb_linear(int fmt, const float *a, int64_t lda, int m, int k, const uint8_t *wp, int n,
                     const float *bias, float *c, int64_t ldc);
/* Whether blocks of 4 rows or more of bfloat16 products run on Intel AMX tiles (same rounding of the
 * operands, float32 sums in a different order): enable = 0 turns that off, 1 back on where the CPU and
 * the build have AMX and the OS grants the tile state. Returns whether AMX is used from now on. */
CB_API int cb_set_amx(int enable);
/* Whether a step of 1-4 rows of float32 products multiplies the weights decoded in registers (rows.c, the
 * default) or takes the tiled path of bigger steps (same sums, bit for bit): enable = 0 turns the few-row
 * path off, 1 back on (benchmarks and tests compare both). Returns the setting before the call. */
CB_API int cb_set_rows(int enable);

/* ---- elementwise (elementwise.c) ----------------------------------------------------------------------- */

/* residual (optional): r = x + r is written back into residual and normalised; otherwise x is.
 * out[i] = w * (r[i] / sqrt(mean(r^2) + eps)). All rows have h elements. */
CB_API int cb_add_rms_norm_f32(const float *x, int64_t ldx, float *residual, int64_t ldr, const float *w,
                               float eps, float *out, int64_t ldo, int m, int h);
/* x: [m, 2 * inter] = [gate | up] per row -> out: [m, inter] = silu(gate) * up. */
CB_API int cb_silu_mul_f32(const float *x, int64_t ldx, int m, int inter, float *out, int64_t ldo);
/* x: [m, 2 * inter] = [gate | up] per row -> out: [m, inter] = gelu(gate) * up, GELU's tanh approximation
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (Gemma's GeGLU). */
CB_API int cb_gelu_tanh_mul_f32(const float *x, int64_t ldx, int m, int inter, float *out, int64_t ldo);
/* In place, rotate-half convention: x holds m rows (ldx floats apart) of `heads` vectors of head_dim floats;
 * row t is rotated by position pos[t] with cos/sin tables [max_pos, head_dim]. */
CB_API int cb_rotary_f32(float *x, int64_t ldx, int m, int heads, int head_dim, const int64_t *pos,
                         const float *cos_t, const float *sin_t, int64_t max_pos);

/* Structured output: in each of rows rows of logits (ld floats apart, vocab tokens), token t is set to -inf
 * unless bit t % 32 of word t / 32 of the row's mask is 1 (mask: [rows, >= ceil(vocab / 32)] int32, mask_ld
 * words apart: xgrammar's token bitmask). */
CB_API int cb_apply_token_bitmask_f32(float *logits, int64_t ld, int rows, int vocab, const int32_t *mask,
                                      int64_t mask_ld);

/* ---- sampling (sampling.c) ------------------------------------------------------------------------------ */

/* The top-p cut of each of rows rows of probabilities (ld floats apart, vocab tokens, non-negative): into
 * threshold[r] the least probability of row r's nucleus (its most likely tokens while the mass before them is
 * below top_p[r]); 0 where top_p[r] >= 1 or the row has no positive probability. */
CB_API int cb_top_p_threshold_f32(const float *probs, int64_t ld, int rows, int vocab, const float *top_p,
                                  float *threshold);
/* Greedy choice: into out[r] the index of the largest of row r's n values (rows ld floats apart), the first on
 * ties, or of its first NaN: torch's max(dim=-1).indices. */
CB_API int cb_argmax_f32(const float *x, int64_t ld, int rows, int n, int64_t *out);

/* ---- multi-LoRA (lora.c) ------------------------------------------------------------------------------- */

/* LoRA of one linear layer for a batch grouped by adapter: for each segment i (seg[4*i .. 4*i+3] = start row,
 * number of rows, slot, columns used), rows r in [start, start + rows): y[r] += (x[r] @ a[slot][:cols]^T) @
 * bt[slot][:cols]. x: [m, in] rows ldx floats apart; y: [m, out] rows ldy apart (added into, not overlapping
 * x); a: [slots, cmax, in] contiguous; bt: [slots, cmax, out] contiguous (B transposed, the scaling folded in).
 * Rows of no segment are untouched; a segment with 0 rows or 0 columns does nothing. cmax <= 1536 (rank 512
 * of a fused q/k/v projection: 3 x 512). Each y element gets its old value, then the columns in order.
 * CB_ERANGE for a negative start, rows, slot or cols, cols > cmax, or segments with rows that overlap (the
 * caller checks start + rows <= m and slot < slots). */
CB_API int cb_lora_add_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int in, int out, const float *a,
                           const float *bt, int cmax, const int32_t *seg, int nseg);
/* As cb_lora_add_f32 with bfloat16 products: a and bt hold bfloat16 values (their 16 bits, half the memory);
 * each x value is rounded to bfloat16 (to nearest even), and so is each t = x @ a[slot][:cols]^T before the
 * expand (as PEFT run in bfloat16), the products summed in float32 into the float32 y. */
CB_API int cb_lora_add_bf16(const float *x, int64_t ldx, float *y, int64_t ldy, int in, int out, const uint16_t *a,
                            const uint16_t *bt, int cmax, const int32_t *seg, int nseg);

/* ---- attention (attention.c) --------------------------------------------------------------------------- */

/* One query token per sequence over its paged keys/values. q, out: [num_seqs, num_heads, head_dim];
 * k/v cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, bt_stride] int32;
 * seq_lens: [num_seqs] int32 in [1, max_seq_len] (a sequence out of range or with a block id outside the
 * cache gives CB_ERANGE and is left unwritten). window > 0: each row attends to its last `window` keys only;
 * softcap > 0: scores are capped to softcap * tanh(s / softcap) before the softmax; 0 turns either off. */
CB_API int cb_paged_decode_f32(const float *q, int64_t q_row_stride, float *out, int64_t out_row_stride,
                               const float *k_cache, const float *v_cache, int num_blocks,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               float scale, int max_seq_len, int window, float softcap);

/* ---- every decoder layer of a step in one call (layers.c) ---------------------------------------------- */

/* x: [n, hidden] this step's token embeddings in, the final hidden states (before the last norm) out.
 * pos, slots: [n] int64; block_tables: [n, bt_stride] int32; seq_lens: [n] int32 (the token's position + 1). */
CB_API int cb_llama_layers(const cb_model_t *md, const cb_layer_t *layers, int n, float *x, const int64_t *pos,
                           const int64_t *slots, const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *seq_lens, int max_seq_len);

#endif
