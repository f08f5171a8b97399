/* GGUF's K-quants and Q5_0 in the linear kernel's panels (CB_FMT_Q4_K, CB_FMT_Q5_K, CB_FMT_Q6_K, CB_FMT_Q5_0: the
 * formats of a Q4_K_M or Q5_K_M file; layouts in panels.h): packing, and
 * decoding a chunk of a panel to float32 for the tiled path (gemm.c via cb_panel_chunk) and the load-time check
 * (cb_unpack_panels). rows.c decodes the same blocks in registers with the same expressions (decode.h), so both
 * paths multiply by gguf-py's dequantized values bit for bit. */
#include "decode.h"

int64_t cb_kquant_panel_bytes(int fmt, int k) {
    if (fmt == CB_FMT_Q5_0) return k < CB_QK || k % CB_QK ? -1 : (int64_t)(k / CB_QK) * Q50_BLOCK;
    if (k < CB_QKK || k % CB_QKK) return -1;
    return (int64_t)(k / CB_QKK) * (fmt == CB_FMT_Q4_K ? Q4K_SUPER : fmt == CB_FMT_Q5_K ? Q5K_SUPER : Q6K_SUPER);
}

/* Q4_K (five = 0) or Q5_K (1: a fifth bit per value from qh) */
static void chunk_q45_k(const int five, const uint8_t *restrict panel, int k0, int kn, float *restrict dst) {
    const int64_t super = five ? Q5K_SUPER : Q4K_SUPER;
    const int bytes = five ? Q5K_BLOCK : Q4K_BLOCK;
    for (int b = k0 / CB_QK, o = 0; o < kn; ++b, o += CB_QK) {
        const uint16_t *d = (const uint16_t *)kq_head(panel, super, b), *dmin = d + CB_NR;
        const uint8_t *blk = kq_block(panel, super, Q4K_HEAD, bytes, b), *q = blk + Q4K_Q;
        for (int v = 0; v < CB_PV; ++v) {
            const vf dv = q4_k_scale(half_value(d + CB_VW * v), blk + CB_VW * v);
            const vf mv = q4_k_offset(half_value(dmin + CB_VW * v), blk + CB_NR + CB_VW * v);
            for (int j = 0; j < CB_QK / 2; ++j) {
                vi pair = widen_u8(q + j * CB_NR + CB_VW * v), lo = pair & 15, hi = pair >> 4;
                if (five) {
                    const vi h4 = widen_u8(blk + Q5K_QH + j / 4 * CB_NR + CB_VW * v) << 4;
                    lo = q5_low(pair, h4, j);
                    hi = q5_high(pair, h4, j);
                }
                float *out = dst + (int64_t)(o + 2 * j) * CB_NR + CB_VW * v;
                cb_store(out, dv * to_float(lo) + mv);
                cb_store(out + CB_NR, dv * to_float(hi) + mv);
            }
        }
    }
}

static void chunk_q6_k(const uint8_t *restrict panel, int k0, int kn, float *restrict dst) {
    for (int b = k0 / CB_QK, o = 0; o < kn; ++b, o += CB_QK) {
        const uint16_t *d = (const uint16_t *)kq_head(panel, Q6K_SUPER, b);
        const uint8_t *blk = kq_block(panel, Q6K_SUPER, Q6K_HEAD, Q6K_BLOCK, b);
        const int8_t *sc = (const int8_t *)blk;
        for (int v = 0; v < CB_PV; ++v) {
            const vf dv = half_value(d + CB_VW * v);
            const vf s0 = q6_k_scale(dv, sc + CB_VW * v), s1 = q6_k_scale(dv, sc + CB_NR + CB_VW * v);
            for (int j = 0; j < CB_QK / 2; ++j) {
                const vi pair = widen_u8(blk + Q6K_QL + j * CB_NR + CB_VW * v);
                const vi h = widen_u8(blk + Q6K_QH + j / 2 * CB_NR + CB_VW * v);
                const vf s = j < CB_QK / 4 ? s0 : s1, off = q6_k_offset(s);
                float *out = dst + (int64_t)(o + 2 * j) * CB_NR + CB_VW * v;
                cb_store(out, q6_k_low(s, off, pair, h, 4 * (j & 1)));
                cb_store(out + CB_NR, q6_k_high(s, off, pair, h, 4 * (j & 1)));
            }
        }
    }
}

static void chunk_q5_0(const uint8_t *restrict blocks, int kn, float *restrict dst) {
    for (int b = 0; b < kn / CB_QK; ++b, blocks += Q50_BLOCK)
        for (int v = 0; v < CB_PV; ++v) {
            const vf dv = half_value((const uint16_t *)blocks + CB_VW * v), mv = dv * -16.0f;
            for (int j = 0; j < CB_QK / 2; ++j) {
                const vi pair = widen_u8(blocks + Q50_Q + j * CB_NR + CB_VW * v);
                const vi h4 = widen_u8(blocks + Q50_QH + j / 4 * CB_NR + CB_VW * v) << 4;
                float *out = dst + (int64_t)(b * CB_QK + 2 * j) * CB_NR + CB_VW * v;
                cb_store(out, dv * to_float(q5_low(pair, h4, j)) + mv);
                cb_store(out + CB_NR, dv * to_float(q5_high(pair, h4, j)) + mv);
            }
        }
}

const float *cb_kquant_chunk(int fmt, const uint8_t *panel, int k0, int kn, float *scratch) {
    if (fmt == CB_FMT_Q5_0)
        chunk_q5_0(panel + (int64_t)(k0 / CB_QK) * Q50_BLOCK, kn, scratch);
    else if (fmt == CB_FMT_Q4_K)
        chunk_q45_k(0, panel, k0, kn, scratch);
    else if (fmt == CB_FMT_Q5_K)
        chunk_q45_k(1, panel, k0, kn, scratch);
    else
        chunk_q6_k(panel, k0, kn, scratch);
    return scratch;
}

/* The float16 bits of x into *h (0 for a padding row); 0 when x is not a float16. */
static int head_scale(float x, int valid, uint16_t *h) {
    if (!valid) {
        *h = 0;
        return 1;
    }
    return cb_float_to_half_exact(x, h);
}

/* Byte [j][c] of a block: k = 2j (low nibble) and 2j + 1 (high) of column c's 32 values v (4 bits each taken). */
static void put_nibbles(uint8_t *dst, int c, const uint8_t *v) {
    for (int j = 0; j < CB_QK / 2; ++j) dst[j * CB_NR + c] = (uint8_t)((v[2 * j] & 15) | (v[2 * j + 1] & 15) << 4);
}

/* Q5_K's fifth bits of column c's 32 values v: bit t of qh's byte [i] for k = 8i + t. */
static void put_fifth_bits(uint8_t *dst, int c, const uint8_t *v) {
    for (int i = 0; i < CB_QK / 8; ++i) {
        uint8_t h = 0;
        for (int t = 0; t < 8; ++t) h |= (uint8_t)(((v[8 * i + t] >> 4) & 1) << t);
        dst[i * CB_NR + c] = h;
    }
}

/* Q4_K (five = 0: values 0..15) or Q5_K (five = 1: 0..31, the fifth bits in their own plane) */
static int pack_q45_k(int five, const float *d, const float *dmin, const uint8_t *sc, const uint8_t *m,
                      const uint8_t *q, int n, int k, uint8_t *out) {
    if (n < 1 || k < CB_QKK || k % CB_QKK) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, ns = k / CB_QKK, nb = k / CB_QK, top = five ? 31 : 15;
    const int64_t super = five ? Q5K_SUPER : Q4K_SUPER;
    const int bytes = five ? Q5K_BLOCK : Q4K_BLOCK;
    static const uint8_t zeros[CB_QK];
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int p = 0; p < panels; ++p)
        for (int s = 0; s < ns; ++s) {
            uint8_t *head = out + ((int64_t)p * ns + s) * super;
            for (int c = 0; c < CB_NR; ++c) {
                const int row = p * CB_NR + c, valid = row < n;
                const int64_t r = valid ? row : 0;
                bad |= !head_scale(d[r * ns + s], valid, (uint16_t *)head + c);
                bad |= !head_scale(dmin[r * ns + s], valid, (uint16_t *)head + CB_NR + c);
                for (int t = 0; t < CB_KSUB; ++t) {
                    uint8_t *blk = head + Q4K_HEAD + t * bytes;
                    const int64_t b = r * nb + s * CB_KSUB + t;
                    const uint8_t *v = valid ? q + r * k + (s * CB_KSUB + t) * CB_QK : zeros;
                    blk[c] = valid ? sc[b] : 0;
                    blk[CB_NR + c] = valid ? m[b] : 0;
                    bad |= (blk[c] | blk[CB_NR + c]) > 63;
                    for (int i = 0; i < CB_QK; ++i) bad |= v[i] > top;
                    put_nibbles(blk + Q4K_Q, c, v);
                    if (five) put_fifth_bits(blk + Q5K_QH, c, v);
                }
            }
        }
    return bad ? CB_ERANGE : CB_OK;
}

int cb_pack_q5_0(const float *d, const uint8_t *q, int n, int k, uint8_t *out) {
    if (n < 1 || k < CB_QK || k % CB_QK) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, nb = k / CB_QK;
    static const uint8_t zeros[CB_QK];
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int p = 0; p < panels; ++p)
        for (int b = 0; b < nb; ++b) {
            uint8_t *blk = out + ((int64_t)p * nb + b) * Q50_BLOCK;
            for (int c = 0; c < CB_NR; ++c) {
                const int row = p * CB_NR + c, valid = row < n;
                const int64_t r = valid ? row : 0;
                const uint8_t *v = valid ? q + r * k + b * CB_QK : zeros;
                bad |= !head_scale(d[r * nb + b], valid, (uint16_t *)blk + c);
                for (int i = 0; i < CB_QK; ++i) bad |= v[i] > 31;
                put_nibbles(blk + Q50_Q, c, v);
                put_fifth_bits(blk + Q50_QH, c, v);
            }
        }
    return bad ? CB_ERANGE : CB_OK;
}

int cb_pack_q4_k(const float *d, const float *dmin, const uint8_t *sc, const uint8_t *m, const uint8_t *q, int n,
                 int k, uint8_t *out) {
    return pack_q45_k(0, d, dmin, sc, m, q, n, k, out);
}

int cb_pack_q5_k(const float *d, const float *dmin, const uint8_t *sc, const uint8_t *m, const uint8_t *q, int n,
                 int k, uint8_t *out) {
    return pack_q45_k(1, d, dmin, sc, m, q, n, k, out);
}

/* One block of Q6_K for column c: its two scales, the low nibbles, and the high 2 bits of k = 4i + t at bits 2t
 * of qh's byte [i]. */
static int put_q6_block(uint8_t *blk, int c, const int8_t *sc, const uint8_t *v) {
    int bad = 0;
    blk[c] = (uint8_t)sc[0];
    blk[CB_NR + c] = (uint8_t)sc[1];
    put_nibbles(blk + Q6K_QL, c, v);
    for (int i = 0; i < CB_QK / 4; ++i) {
        uint8_t h = 0;
        for (int t = 0; t < 4; ++t) {
            bad |= v[4 * i + t] > 63;
            h |= (uint8_t)(((v[4 * i + t] >> 4) & 3) << (2 * t));
        }
        blk[Q6K_QH + i * CB_NR + c] = h;
    }
    return bad;
}

int cb_pack_q6_k(const float *d, const int8_t *sc, const uint8_t *q, int n, int k, uint8_t *out) {
    if (n < 1 || k < CB_QKK || k % CB_QKK) return CB_EINVAL;
    const int panels = (n + CB_NR - 1) / CB_NR, ns = k / CB_QKK, nsc = k / (CB_QK / 2);
    static const uint8_t zeros[CB_QK];
    static const int8_t no_scales[2];
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int p = 0; p < panels; ++p)
        for (int s = 0; s < ns; ++s) {
            uint8_t *head = out + ((int64_t)p * ns + s) * Q6K_SUPER;
            for (int c = 0; c < CB_NR; ++c) {
                const int row = p * CB_NR + c, valid = row < n;
                const int64_t r = valid ? row : 0;
                bad |= !head_scale(d[r * ns + s], valid, (uint16_t *)head + c);
                for (int t = 0; t < CB_KSUB; ++t) {
                    const int b = s * CB_KSUB + t;
                    bad |= put_q6_block(head + Q6K_HEAD + t * Q6K_BLOCK, c, valid ? sc + r * nsc + 2 * b : no_scales,
                                        valid ? q + r * k + b * CB_QK : zeros);
                }
            }
        }
    return bad ? CB_ERANGE : CB_OK;
}
