/* All decoder layers of a Llama-family model for one step in one call: every query token of the step, be it
 * a request's one new token or a token of a prefill chunk, is a row with its own block table and context
 * length (../../attention/cpu_backend.py builds them), attended by the paged kernel of attention.c.
 *
 * It runs the same kernels as the per-module path of ../../models/decoder.py, in the same order and on the
 * same values, so the result is bit for bit what that path gives; what it saves is the Python around ~9 kernel
 * calls a layer (argument checks, tensor allocation, module dispatch): 5.6-8.5 ms of a 34-112 ms SmolLM2
 * decode step with 12-64 requests on the 2-core benchmark machine. Per layer:
 *
 *   residual += x; h = rmsnorm(residual)                 (residual starts at 0: layer 0 gets x + 0 = x)
 *   qkv = h W_qkv^T (+ b_qkv);  (per-head RMSNorm of q and k, where the layer has them: Qwen3)
 *   rotary on q and k;  k, v -> cache slots
 *   a = paged decode attention(q), over the layer's sliding window if it has one
 *   x = a W_o^T (+ b_o, added after the product, as the module does)
 *   residual += x; h = rmsnorm(residual);  x = silu(h W_gate^T) * (h W_up^T);  x = x W_down^T (+ b_down)
 *
 * Gemma's layer (pre_ff_norm and post_ff_norm set) norms the attention output before adding it, and the MLP's
 * output likewise; its MLP is GeGLU (model act 1), its attention logits may be soft-capped, and its sliding
 * layers may have rotary tables of their own (Gemma 3's local base).
 *
 * and at the end x += residual. Tensor parallelism is not handled here (no all-reduce): the model uses
 * this path only for a single rank.
 */
#include <stdlib.h>

#include "cb_simd.h"
#include "panels.h"

/* out [m, lin.n] = a [m, lin.k] W^T (+ bias); a weight in parts (lin.rest) as one product per part, each into its
 * own columns of out */
static int linear(const cb_lin_t *lin, const float *a, int m, float *out) {
    int rc = CB_OK;
    for (const cb_lin_t *p = lin; p && !rc; p = p->rest) {
        const int col = lin->n - p->n, rows = p->rest ? p->split : p->n;
        const float *bias = lin->bias_in_kernel && lin->bias ? lin->bias + col : NULL;
        rc = cb_linear(p->fmt, a, lin->k, m, lin->k, p->w, rows, bias, out + col, lin->n);
    }
    if (rc || !lin->bias || lin->bias_in_kernel) return rc;
    for (int i = 0; i < m; ++i)
        for (int j = 0; j < lin->n; ++j) out[(int64_t)i * lin->n + j] += lin->bias[j];
    return CB_OK;
}

/* k and v of each token (the tail of its qkv row) into its cache slot (slots checked by rows_ok). */
static int write_kv(const cb_model_t *md, const cb_layer_t *ly, const float *qkv, int64_t ldq, int n,
                    const int64_t *slots) {
    const int64_t kv = (int64_t)md->kv_heads * md->head_dim, q = (int64_t)md->heads * md->head_dim;
    for (int t = 0; t < n; ++t) {
        memcpy(ly->k_cache + slots[t] * kv, qkv + t * ldq + q, sizeof(float) * (size_t)kv);
        memcpy(ly->v_cache + slots[t] * kv, qkv + t * ldq + q + kv, sizeof(float) * (size_t)kv);
    }
    return CB_OK;
}

/* In place: each of the n rows' `heads` vectors of head_dim floats (starting at x, rows ldx apart) RMS-normed
 * with weight w: the per-head q/k norms (the same kernel, row by row, that the module path runs). */
static int norm_heads(float *x, int64_t ldx, int n, int heads, int head_dim, const float *w, float eps) {
    int rc = CB_OK;
    for (int t = 0; t < n && !rc; ++t)
        rc = cb_add_rms_norm_f32(x + t * ldx, head_dim, NULL, 0, w, eps, x + t * ldx, head_dim, heads, head_dim);
    return rc;
}

static int layer(const cb_model_t *md, const cb_layer_t *ly, int n, float *x, float *residual, float *h, float *qkv,
                 float *att, float *gu, float *act, const int64_t *pos, const int64_t *slots, const int32_t *bt,
                 int64_t bt_stride, const int32_t *seq_lens, int max_seq_len) {
    const int hid = md->hidden, hd = md->head_dim, qn = ly->qkv.n, an = md->heads * hd;
    int rc = cb_add_rms_norm_f32(x, hid, residual, hid, ly->in_norm, md->eps, h, hid, n, hid);
    if (!rc) rc = linear(&ly->qkv, h, n, qkv);
    if (!rc && ly->q_norm) rc = norm_heads(qkv, qn, n, md->heads, hd, ly->q_norm, md->eps);
    if (!rc && ly->k_norm) rc = norm_heads(qkv + an, qn, n, md->kv_heads, hd, ly->k_norm, md->eps);
    const float *cos_t = ly->cos ? ly->cos : md->cos, *sin_t = ly->sin ? ly->sin : md->sin;
    if (!rc) rc = cb_rotary_f32(qkv, qn, n, md->heads + md->kv_heads, hd, pos, cos_t, sin_t, md->max_pos);
    if (!rc) rc = write_kv(md, ly, qkv, qn, n, slots);
    if (!rc)
        rc = cb_paged_decode_f32(qkv, qn, att, an, ly->k_cache, ly->v_cache, md->num_blocks, bt, bt_stride, seq_lens, n,
                                 md->heads, md->kv_heads, hd, md->block_size, md->scale, max_seq_len, ly->window,
                                 ly->softcap);
    if (!rc) rc = linear(&ly->o, att, n, x);
    if (ly->pre_ff_norm) { /* Gemma: the attention output normed alone, then added; the MLP's input normed */
        if (!rc) rc = cb_add_rms_norm_f32(x, hid, NULL, 0, ly->post_norm, md->eps, x, hid, n, hid);
        if (!rc) rc = cb_add_rms_norm_f32(x, hid, residual, hid, ly->pre_ff_norm, md->eps, h, hid, n, hid);
    } else if (!rc) {
        rc = cb_add_rms_norm_f32(x, hid, residual, hid, ly->post_norm, md->eps, h, hid, n, hid);
    }
    if (!rc) rc = linear(&ly->gate_up, h, n, gu);
    if (!rc)
        rc = (md->act ? cb_gelu_tanh_mul_f32 : cb_silu_mul_f32)(gu, 2 * (int64_t)md->inter, n, md->inter, act,
                                                               md->inter);
    if (!rc) rc = linear(&ly->down, act, n, x);
    if (!rc && ly->post_ff_norm) rc = cb_add_rms_norm_f32(x, hid, NULL, 0, ly->post_ff_norm, md->eps, x, hid, n, hid);
    return rc;
}

/* Every slot, position and context length in range before anything is written (the kernels check their
 * own indices too, but a failure half-way would leave some layers' caches written). */
static int rows_ok(const cb_model_t *md, int n, const int64_t *pos, const int64_t *slots, const int32_t *seq_lens,
                   int max_seq_len) {
    const int64_t num_slots = (int64_t)md->num_blocks * md->block_size;
    for (int t = 0; t < n; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots || pos[t] < 0 || pos[t] >= md->max_pos || seq_lens[t] < 1 ||
            seq_lens[t] > max_seq_len)
            return 0;
    return 1;
}

static int shapes_ok(const cb_model_t *md, const cb_layer_t *ly) {
    const int hid = md->hidden, an = md->heads * md->head_dim;
    return ly->qkv.k == hid && ly->qkv.n == an + 2 * md->kv_heads * md->head_dim && ly->o.k == an &&
           ly->o.n == hid && ly->gate_up.k == hid && ly->gate_up.n == 2 * md->inter && ly->down.k == md->inter &&
           ly->down.n == hid && ly->k_cache && ly->v_cache && ly->in_norm && ly->post_norm && ly->window >= 0 &&
           ly->softcap >= 0.0f && !ly->pre_ff_norm == !ly->post_ff_norm && !ly->cos == !ly->sin;
}

/* x: [n, hidden] this step's token embeddings in, the final hidden states (before the last norm) out.
 * pos, slots: [n] int64; block_tables: [n, bt_stride] int32; seq_lens: [n] int32 (the token's position + 1). */
int cb_llama_layers(const cb_model_t *md, const cb_layer_t *layers, int n, float *x, const int64_t *pos,
                     const int64_t *slots, const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     int max_seq_len) {
    if (n < 0 || md->num_layers < 1 || md->kv_heads < 1 || md->heads % md->kv_heads || md->act < 0 || md->act > 1)
        return CB_EINVAL;
    for (int l = 0; l < md->num_layers; ++l)
        if (!shapes_ok(md, &layers[l])) return CB_EINVAL;
    if (n == 0) return CB_OK;
    if (!rows_ok(md, n, pos, slots, seq_lens, max_seq_len)) return CB_ERANGE;
    const int64_t hid = md->hidden, per_row = 2 * hid + layers[0].qkv.n + (int64_t)md->heads * md->head_dim +
                                              3 * (int64_t)md->inter;
    float *work = malloc(sizeof(float) * (size_t)(per_row * n));
    if (!work) return CB_ENOMEM;
    float *residual = work, *h = residual + n * hid, *qkv = h + n * hid;
    memset(residual, 0, sizeof(float) * (size_t)(n * hid));
    float *att = qkv + n * (int64_t)layers[0].qkv.n, *gu = att + n * (int64_t)md->heads * md->head_dim;
    float *act = gu + n * 2 * (int64_t)md->inter;
    int rc = CB_OK;
    for (int l = 0; l < md->num_layers && !rc; ++l)
        rc = layer(md, &layers[l], n, x, residual, h, qkv, att, gu, act, pos, slots, block_tables, bt_stride,
                   seq_lens, max_seq_len);
    if (!rc)
        for (int64_t i = 0; i < n * hid; ++i) x[i] += residual[i];
    free(work);
    return rc;
}
