"""CPU benchmark of a mixture-of-experts model: cbserve against HF transformers, in one run.

The model is Qwen3-MoE-shaped with random weights (defaults: hidden 512, 12 layers, 32 experts of width 384,
top-4 routing, 8 query / 4 key-value heads of 64, a 32000-word vocabulary: ~270M parameters, ~50M active per
token), saved with transformers into a temporary folder with a word-level tokenizer. Both systems get the
same batch of random prompts (mixed lengths), greedy, ``--max-new`` tokens each (EOS ignored):

  - HF transformers: ``generate`` on the whole batch at once (left padding), fp32, with each experts
    implementation of ``--hf-experts`` (transformers 5's default ``grouped_mm``, and ``eager``: its loop over
    the routed experts); the ratio is taken against the fastest;
  - cbserve: ``LLM.generate`` in-process (continuous batching, the CPU ops chosen by ``--cpu-ops``), fp32.

Prints generated tokens per second of each and the ratio, and how many requests' greedy tokens agree
(HF's padded batch is not bit-identical to unpadded runs, so a few may part ways after a near-tie).

``--bf16-values`` rounds the random weights to bfloat16 values first, like a bf16 checkpoint served in fp32:
cbserve then stores the experts as bfloat16 panels (the same float32 values, half the bytes to read).

    python benchmarks/bench_moe.py                        # a few minutes on 2 cores
    python benchmarks/bench_moe.py --layers 2 --num-prompts 4 --max-new 8     # smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=96)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--hf-experts", nargs="+", default=["grouped_mm", "eager"],
                   help="HF experts implementations to time (set_experts_implementation)")
    p.add_argument("--bf16-values", action="store_true",
                   help="round the random weights to bfloat16 values, as a bf16 checkpoint served in fp32 (cbserve "
                        "then keeps them as bf16 panels: the same float32 arithmetic, half the bytes read)")
    p.add_argument("--cpu-ops", default="auto", choices=["auto", "native", "onednn", "torch"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    return p.parse_args()


def build_model(args: argparse.Namespace, folder: Path) -> Any:
    """A random Qwen3-MoE model (fp32) saved into ``folder`` with a word-level tokenizer; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_inter,
        intermediate_size=4 * args.hidden, norm_topk_prob=True, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # a router that prefers some experts, like a trained one, not a flat one
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            if args.bf16_values:
                p.copy_(p.bfloat16().float())
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, args.vocab)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    return model


def param_counts(model: Any, top_k: int, experts: int) -> tuple[int, int]:
    """(total parameters, parameters active for one token: the experts counted top_k / experts)."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return total, total - expert + expert * top_k // experts


def run_hf(model: Any, prompts: list[list[int]], max_new: int, experts: str) -> dict[str, Any]:
    model.set_experts_implementation(experts)
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(input_ids=ids[:1, -4:], attention_mask=mask[:1, -4:], max_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                             **kw)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": [out[i, width:].tolist() for i in range(len(prompts))]}


def run_cbserve(folder: Path, prompts: list[list[int]], max_new: int, cpu_ops: str) -> dict[str, Any]:
    from cbserve import LLM, SamplingParams

    llm = LLM(str(folder), max_num_seqs=len(prompts), max_num_batched_tokens=1024, enable_prefix_caching=False,
              progress=False, cpu_ops=cpu_ops)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return {"seconds": seconds, "tokens": [list(r.outputs[0].token_ids) for r in res]}


def main() -> int:
    args = parse_args()
    from cbserve.worker.loading.model_loader import hide_triton_from_torch

    hide_triton_from_torch()  # no Triton on a CPU run (and none of its exit-time noise)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_prompts)]
    with tempfile.TemporaryDirectory(prefix="bench_moe.") as tmp:
        folder = Path(tmp)
        model = build_model(args, folder)
        total, active = param_counts(model, args.top_k, args.experts)
        print(f"Qwen3-MoE random model: {total / 1e6:.0f}M parameters ({active / 1e6:.0f}M active per token), "
              f"{args.layers} layers, {args.experts} experts top-{args.top_k}, hidden {args.hidden}; "
              f"{args.num_prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.max_new} new "
              f"tokens each, greedy, fp32{' (bf16 values)' if args.bf16_values else ''}, "
              f"{torch.get_num_threads()} torch threads")
        hf = {impl: run_hf(model, prompts, args.max_new, impl) for impl in args.hf_experts}
        del model
        ours = run_cbserve(folder, prompts, args.max_new, args.cpu_ops)
    generated = args.num_prompts * args.max_new
    rates = {f"HF transformers generate, experts={impl}": generated / r["seconds"] for impl, r in hf.items()}
    best_hf = max(rates.values())
    our_rate = generated / ours["seconds"]
    for (label, rate), r in zip(rates.items(), hf.values(), strict=True):
        print(f"{label:44s} {r['seconds']:7.2f} s  {rate:8.1f} tok/s")
    print(f"{'cbserve LLM.generate, cpu_ops=' + args.cpu_ops:44s} {ours['seconds']:7.2f} s  {our_rate:8.1f} tok/s")
    agree = {impl: sum(a == b for a, b in zip(r["tokens"], ours["tokens"], strict=True)) for impl, r in hf.items()}
    print(f"ratio cbserve / fastest HF: {our_rate / best_hf:.2f}x; greedy outputs equal to HF's: "
          + ", ".join(f"{impl} {n}/{args.num_prompts}" for impl, n in agree.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "params": total, "active_params": active, "hf_tok_s": rates,
            "cbserve_tok_s": our_rate, "ratio_vs_fastest_hf": our_rate / best_hf, "greedy_equal": agree,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
