"""Write a tiny HF model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does (its tensor names and
metadata keys, the q/k rotary permutation of llama-architecture models, Gemma's norm weights stored as 1 + w,
Qwen-MoE experts stacked per projection), with a tokenizer in the ``tokenizer.ggml.*`` keys that
transformers' GGUF loader reads back (byte-level BPE; SentencePiece for Gemma, as llama.cpp writes them).
No llama.cpp needed: the ``gguf`` package writes the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

_LETTERS = "etaoinshrdl"


def _bpe_vocab(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE (llama.cpp's "gpt2"): 3 control tokens, the 256 byte symbols, then letter pairs."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pairs = [(a, b) for a in _LETTERS for b in _LETTERS][: vocab - 3 - 256]
    tokens = ["<unk>", "<s>", "</s>", *bytes_to_unicode().values(), *(a + b for a, b in pairs)]
    return tokens, [3, 3, 3] + [1] * (len(tokens) - 3), [f"{a} {b}" for a, b in pairs]


def _spm_vocab(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """SentencePiece (llama.cpp's "llama", as Gemma files have): 3 control tokens, 256 byte-fallback tokens,
    then the pieces: single symbols, then pairs (no merges stored: transformers derives them)."""
    singles = ["\u2581", *_LETTERS]
    pairs = [a + b for a in singles for b in _LETTERS][: vocab - 3 - 256 - len(singles)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *singles, *pairs]
    return tokens, [3, 3, 3] + [6] * 256 + [1] * (len(singles) + len(pairs)), []  # 6: byte


def _add_tokenizer(w: Any, vocab: int, spm: bool) -> None:
    tokens, types, merges = _spm_vocab(vocab) if spm else _bpe_vocab(vocab)
    w.add_tokenizer_model("llama" if spm else "gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)  # 3: control, 1: normal
    if spm:
        w.add_token_scores([-float(i) for i in range(len(tokens))])
    else:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)


def _rope_theta(cfg: Any) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: one entry per layer type
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _add_hparams(w: Any, arch: str, cfg: Any) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "sliding_window", None) and arch in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "llama" and getattr(cfg, "num_local_experts", None):  # Mixtral, as llama.cpp writes it
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (rotary halves interleaved), which transformers' loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(arch: str, cfg: Any, state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, in llama.cpp's layout."""
    import gguf

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue
        base, dot, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        arr = t.detach().float().numpy().copy()
        if base.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            blk = base.split(".")[2]
            half = arr.shape[1] // 2
            out[f"blk.{blk}.ffn_gate_exps.weight"], out[f"blk.{blk}.ffn_up_exps.weight"] = arr[:, :half], arr[:, half:]
            continue
        if base.endswith("mlp.experts.down_proj"):  # [E, H, I]
            out[f"blk.{base.split('.')[2]}.ffn_down_exps.weight"] = arr
            continue
        name = names.get_name(base)
        if name is None:
            raise KeyError(f"no GGUF name for {hf_name} ({arch})")
        name += f".{suffix}" if dot else ".weight"
        if arch == "llama" and ".attn_q." in name:
            arr = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            arr = _permute(arr, cfg.num_key_value_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


def _q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of 256-value blocks quantized as GGUF Q6_K (a plain round-to-nearest, not llama.cpp's search): per
    16 values an int8 scale under a float16 one per block, values 0..63 stored as q - 32."""
    g = x.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(g).max(axis=2) / 31.0
    d = (scale.max(axis=1) / 127.0).astype(np.float16)
    safe_d = np.where(d == 0, 1.0, d.astype(np.float32))[:, None]
    sc = np.clip(np.round(scale / safe_d), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(g / np.where(step == 0, 1.0, step)[:, :, None]), -32, 31).astype(np.int16) + 32
    v = q.reshape(-1, 2, 128).astype(np.uint8)
    ql = (v[:, :, :64] & 15) | ((v[:, :, 64:] & 15) << 4)
    hi = (v >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | hi[:, :, 1] << 2 | hi[:, :, 2] << 4 | hi[:, :, 3] << 6
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(x.shape[0], -1)


def _q4_k(x: np.ndarray, top: int = 15) -> np.ndarray:
    """Rows of 256-value blocks quantized as GGUF Q4_K (round-to-nearest): per 32 values a 6-bit scale and min
    under float16 ones per block, values 0..15; the 12 bytes of scales packed as llama.cpp packs them. ``top`` 31:
    Q5_K, the values' fifth bits in 32 bytes before the nibbles (bit i of byte j: value j of the i-th 32)."""
    g = x.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(g.min(axis=2), 0.0)
    scale, mins = (g.max(axis=2) - lo) / float(top), -lo
    d, dmin = (scale.max(axis=1) / 63.0).astype(np.float16), (mins.max(axis=1) / 63.0).astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1.0, d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.where(dmin == 0, 1.0, dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((g + offset[:, :, None]) / np.where(step == 0, 1.0, step)[:, :, None]), 0, top)
    q = q.astype(np.uint8)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    v = (q & 15).reshape(-1, 4, 64)
    qs = (v[:, :, :32] | v[:, :, 32:] << 4).reshape(-1, 128)
    fifth = [((q >> 4) & 1)[:, i, :] << i for i in range(8)] if top == 31 else []
    qh = [np.bitwise_or.reduce(np.stack(fifth), axis=0).astype(np.uint8)] if fifth else []
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, *qh, qs],
                            axis=1)
    return blocks.reshape(x.shape[0], -1)


# Q4_K_M / Q5_K_M as llama.cpp mixes them (simplified): Q6_K for the value and down projections and the output,
# Q4_K / Q5_K for the rest
_K_M_SIX = ("attn_v.weight", "ffn_down.weight", "output.weight")


def tensor_type(tname: str, arr: np.ndarray, qtype: str) -> str:
    """The GGUF type a 2-D weight gets under ``qtype`` ("Q4_K_M" mixes Q4_K and Q6_K, "Q5_K_M" Q5_K and Q6_K); rows
    that are not whole 256-value blocks fall back as llama.cpp's do: Q6_K to Q8_0, Q4_K (and here Q5_K) to Q5_0."""
    if qtype in ("Q4_K_M", "Q5_K_M"):
        qtype = "Q6_K" if tname.endswith(_K_M_SIX) else qtype[:4]
    if qtype.endswith("_K") and arr.shape[-1] % 256:
        return "Q8_0" if qtype == "Q6_K" else "Q5_0"
    return qtype


def quantize(arr: np.ndarray, qtype: str) -> np.ndarray:
    """``arr``'s rows as GGUF blocks of ``qtype``: gguf-py's quantizer, or the K-quants' here (gguf-py has none)."""
    import gguf

    if qtype in ("Q4_K", "Q5_K"):
        return _q4_k(arr, 31 if qtype == "Q5_K" else 15)
    if qtype == "Q6_K":
        return _q6_k(arr)
    return gguf.quants.quantize(arr, gguf.GGMLQuantizationType[qtype])


def write_gguf(folder: Path, path: Path, arch: str, name: str = "tiny", qtype: str | None = None) -> Path:
    """Write the HF model saved in ``folder`` as the GGUF file ``path`` of llama.cpp architecture ``arch``
    (Mistral and Mixtral are "llama"), ``general.name`` ``name``. ``qtype`` ("Q8_0", "Q4_K_M", ...): the 2-D
    weights quantized (norms stay F32, as llama.cpp keeps them; ``tensor_type``)."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    _add_hparams(w, arch, cfg)
    _add_tokenizer(w, cfg.vocab_size, spm=arch.startswith("gemma"))
    for tname, arr in _gguf_tensors(arch, cfg, model.state_dict()).items():
        if qtype is not None and arr.ndim == 2 and not tname.endswith("norm.weight"):
            kind = tensor_type(tname, arr, qtype)
            w.add_tensor(tname, quantize(arr, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
