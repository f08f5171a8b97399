"""FP8 accuracy against bf16: greedy agreement and the mean KL divergence of next-token distributions, for FP8
weights (``quantization="fp8"``), an FP8 KV cache (``kv_cache_dtype="fp8"``) and both.

    .venv/bin/python benchmarks/bench_fp8_accuracy.py                    # the bundled SmolLM2 on CPU (emulated FP8)
    .venv/bin/python benchmarks/bench_fp8_accuracy.py --prompts 8 --max-tokens 16 --out results/fp8_accuracy.json

Every variant is the same bf16 model through the same engine (``EngineCore`` over a ``LocalExecutor``, greedy,
EOS ignored); only the FP8 settings differ. On CPU the model runs on the torch ops and the torch attention backend
(where the FP8 emulation runs: e4m3 values and scales as on a GPU, products in float32). Per variant:

- greedy agreement: the share of the generated tokens before the first one that differs from bf16's (per prompt,
  then the mean), and how many sequences are identical to bf16's;
- teacher-forced, over bf16's own sequences (prompt + bf16's continuation, one prefill): at each generated
  position KL(p_bf16 || p_variant) of the next-token distributions (mean and max, nats) and the share of
  positions whose argmax is bf16's (for bf16 itself: the share where its prefill's argmax is the token its decode
  steps chose, the noise floor of greedy agreement).

``measure(fields, prompts, max_tokens, weights)`` is the same measurement for another script: ``fields`` are
``ModelConfig``'s (e.g. a Llama-shaped folder on CUDA with ``weights`` a callable returning its random tensors).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from cpu_info import cpu_model

from cbserve.scheduler.config import CacheConfig, EngineConfig, SchedulerConfig
from cbserve.scheduler.engine_core import EngineCore
from cbserve.scheduler.requests.request import EngineRequest
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.fp8 import dequantize_rows, quantize_rows
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.runner.input_batch import CachedRequestState, build_batch

VARIANTS: dict[str, dict[str, str]] = {
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
CPU_FIELDS = {"dtype": "bfloat16", "device": "cpu", "cpu_ops": "torch", "attention_backend": "torch"}
PROMPTS = [
    "The capital of France is",
    "Continuous batching in a language model server means",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "A good breakfast includes",
    "The speed of light is about",
    "To make a cup of tea, first",
    "In 1969, the first humans",
    "The difference between a list and a tuple in Python is",
    "Once upon a time, in a small village,",
    "The main causes of the French Revolution were",
    "SELECT name FROM users WHERE",
    "The best way to learn a new language is",
    "Water boils at",
]
WeightsFn = Callable[[], Iterable[tuple[str, torch.Tensor]]]
Fields = dict[str, Any]


@dataclass
class VariantResult:
    greedy_prefix_agreement: float  # mean over prompts of (tokens before the first difference) / max_tokens
    identical_sequences: int
    top1_agreement: float  # teacher-forced: positions whose argmax is bf16's argmax
    mean_kl: float  # teacher-forced KL(p_bf16 || p_variant), nats, over every generated position
    max_kl: float
    seconds: float


def _executor(fields: Fields, num_blocks: int, weights: WeightsFn | None) -> LocalExecutor:
    return LocalExecutor(
        ModelConfig(**fields), num_blocks, progress=False, weights=weights() if weights is not None else None
    )


def greedy(executor: LocalExecutor, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``max_tokens`` tokens (EOS ignored), all prompts in one engine."""
    mc = executor.runner.config
    sched = SchedulerConfig(
        max_num_batched_tokens=mc.max_num_batched_tokens,
        max_num_seqs=mc.max_num_seqs,
        max_model_len=executor.runner.max_model_len,
    )
    cache = CacheConfig(block_size=mc.block_size, num_blocks=executor.num_blocks, enable_prefix_caching=False)
    engine = EngineCore(EngineConfig(scheduler=sched, cache=cache), executor)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, sp))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            out[o.req_id].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def teacher_forced_logprobs(executor: LocalExecutor, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log p(next token) at each of ``continuation``'s positions [len(continuation), vocab] (float32), from one
    prefill of prompt + continuation (but its last token) into blocks 0.. of the executor's (idle) KV cache."""
    runner = executor.runner
    ids = prompt + continuation[:-1]
    blocks = list(range(-(-len(ids) // runner.block_size)))
    state = CachedRequestState("tf", ids, len(ids), SamplingParams(), blocks, 0)
    batch = build_batch([state], {"tf": len(ids)}, runner.block_size, runner.device)
    batch.logits_rows = torch.arange(len(prompt) - 1, len(ids), device=runner.device)
    logits = runner.forward_logits(batch, runner.kv_caches)
    return torch.log_softmax(logits.float(), dim=-1)


def _prefix_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _compare(
    base: list[list[int]], base_lp: list[torch.Tensor], tokens: list[list[int]], lps: list[torch.Tensor], seconds: float
) -> VariantResult:
    n = len(base[0])
    kls = torch.cat([(b.exp() * (b - v)).sum(-1) for b, v in zip(base_lp, lps, strict=True)])
    top1 = torch.cat([v.argmax(-1) == b.argmax(-1) for b, v in zip(base_lp, lps, strict=True)])
    return VariantResult(
        greedy_prefix_agreement=sum(map(_prefix_agreement, tokens, base)) / (n * len(base)),
        identical_sequences=sum(a == b for a, b in zip(tokens, base, strict=True)),
        top1_agreement=float(top1.float().mean()),
        mean_kl=float(kls.mean()),
        max_kl=float(kls.max()),
        seconds=seconds,
    )


def measure(
    fields: Fields,
    prompts: list[list[int]],
    max_tokens: int,
    weights: WeightsFn | None = None,
    variants: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """bf16 (``fields`` as given) and each FP8 variant (``fields`` plus its settings) on ``prompts`` (token ids):
    {"bf16": {"top1_agreement", "seconds"}, name: VariantResult as a dict}. One model is loaded at a time;
    ``weights``: a callable giving a fresh iterator of HF-named tensors (random weights) for each load."""
    need = sum(-(-(len(p) + max_tokens) // fields.get("block_size", 16)) for p in prompts) + 4
    t0 = time.perf_counter()
    ex = _executor(fields, need, weights)
    base = greedy(ex, prompts, max_tokens)
    base_lp = [teacher_forced_logprobs(ex, p, c) for p, c in zip(prompts, base, strict=True)]
    own = torch.cat([lp.argmax(-1).cpu() == torch.tensor(t) for lp, t in zip(base_lp, base, strict=True)])
    results: dict[str, Any] = {
        "bf16": {"top1_agreement": float(own.float().mean()), "seconds": time.perf_counter() - t0}
    }
    ex.shutdown()
    del ex
    for name, extra in (variants or VARIANTS).items():
        t0 = time.perf_counter()
        ex = _executor({**fields, **extra}, need, weights)
        tokens = greedy(ex, prompts, max_tokens)
        lps = [teacher_forced_logprobs(ex, p, c) for p, c in zip(prompts, base, strict=True)]
        results[name] = asdict(_compare(base, base_lp, tokens, lps, time.perf_counter() - t0))
        ex.shutdown()
        del ex, lps
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def smollm2_prompts(n: int) -> list[list[int]]:
    """The first ``n`` of PROMPTS (cycled) tokenized by the bundled SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from cbserve.worker.loading.model_loader import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None).folder))
    return [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]


@torch.inference_mode()
def hf_fake_quant(prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """The weights variant's figures from an implementation that shares nothing with cbserve's model: HF
    transformers' SmolLM2 in bfloat16 with every linear layer but the LM head fake-quantized (weights per output
    channel, inputs per token, to e4m3 values and back), teacher-forced over HF's own greedy continuations."""
    from transformers import AutoModelForCausalLM

    from cbserve.worker.loading.model_loader import resolve_model

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(None).folder), dtype=torch.bfloat16).eval()
    seqs = [model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0].tolist() for p in prompts]  # fmt: skip

    def logprobs() -> torch.Tensor:
        rows = [model(torch.tensor([s[:-1]])).logits[0, len(p) - 1 :] for p, s in zip(prompts, seqs, strict=True)]
        return torch.log_softmax(torch.cat(rows).float(), dim=-1)

    base = logprobs()
    for name, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear) and not name.endswith("lm_head"):
            layer.weight.data = dequantize_rows(*quantize_rows(layer.weight), torch.bfloat16)
            layer.register_forward_pre_hook(lambda _m, args: (dequantize_rows(*quantize_rows(args[0]), args[0].dtype),))
    fp8 = logprobs()
    kl = (base.exp() * (base - fp8)).sum(-1)
    return {"mean_kl": float(kl.mean()), "top1_agreement": float((base.argmax(-1) == fp8.argmax(-1)).float().mean())}


def _print(record: dict[str, Any]) -> None:
    results, n = record["results"], record["prompts"]
    print(
        f"{record['model']} on {record['cpu']}, {record['threads']} threads: {n} prompts x "
        f"{record['max_tokens']} greedy tokens against bf16"
    )
    print(f"{'variant':<12} {'greedy agree':>12} {'identical':>9} {'top-1':>7} {'mean KL':>9} {'max KL':>8}")
    print(
        f"{'bf16':<12} {'':>22} {results['bf16']['top1_agreement']:>7.3f}  (its prefill's argmax against its "
        "own greedy tokens)"
    )
    for name, r in results.items():
        if name != "bf16":
            print(
                f"{name:<12} {r['greedy_prefix_agreement']:>12.3f} {r['identical_sequences']:>5}/{n:<3} "
                f"{r['top1_agreement']:>7.3f} {r['mean_kl']:>9.5f} {r['max_kl']:>8.4f}"
            )
    hf = record.get("hf_fake_quant_weights")
    if hf is not None:
        print(
            f"{'HF weights':<12} {'':>22} {hf['top1_agreement']:>7.3f} {hf['mean_kl']:>9.5f}  (HF transformers, "
            "the same quantization faked)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--hf-check", action="store_true", help="also the weights variant on HF transformers' model")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = smollm2_prompts(args.prompts)
    t0 = time.perf_counter()
    results = measure(dict(CPU_FIELDS), prompts, args.max_tokens)
    record = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF, Q4_1, loaded in bfloat16)",
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "fields": CPU_FIELDS,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "results": results,
    }
    if args.hf_check:
        record["hf_fake_quant_weights"] = hf_fake_quant(prompts, args.max_tokens)
    _print(record)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
