"""Multi-LoRA throughput on CPU: one burst of requests through cbserve's offline engine (the engine behind
``cbserve serve``) on the bundled SmolLM2-135M, with no adapter and with 1, 4 and 16 random rank-16 adapters on
every attention and MLP projection, the requests spread uniformly over the adapters (``max_loras`` = the number
of adapters, so every step mixes all of them). Prints output tokens/s per case and its ratio to the base
model's, measured in one run, and writes a JSON and a plot.

    .venv/bin/python benchmarks/bench_lora.py --requests 64 --out-dir benchmarks/results/lora
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import describe  # noqa: E402

from cbserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402
from cbserve.worker.loading.model_info import read_model_info  # noqa: E402
from cbserve.worker.lora.files import SPLIT_PROJECTIONS, projection_shapes  # noqa: E402


def write_adapter(folder: Path, model: str | None, rank: int, seed: int) -> Path:
    """A random PEFT adapter of ``rank`` on every projection of ``model`` (the format PEFT saves)."""
    from safetensors.torch import save_file

    info = read_model_info(model)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(info.num_hidden_layers):
        for proj, (fan_in, fan_out) in projection_shapes(info).items():
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(SPLIT_PROJECTIONS),
              "bias": "none", "base_model_name_or_path": "SmolLM2-135M-Instruct"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def burst(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(64, 192))] for _ in range(n)]


def run_case(num_adapters: int, adapters: list[LoRARequest], prompts: list[list[int]], max_tokens: int,
             max_rank: int) -> dict:
    lora_kw = dict(enable_lora=True, max_loras=num_adapters, max_lora_rank=max_rank) if num_adapters else {}
    llm = LLM(None, progress=False, **lora_kw)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    loras = [adapters[i % num_adapters] if num_adapters else None for i in range(len(prompts))]
    llm.generate(prompts[:4], params, lora_request=loras[:4], use_tqdm=False)  # warm-up: loads every path
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"adapters": num_adapters, "output_tokens": tokens, "seconds": elapsed, "output_tok_s": tokens / elapsed}


def plot(results: list[dict], machine: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    labels = ["base" if r["adapters"] == 0 else f"{r['adapters']} adapter{'s' * (r['adapters'] > 1)}"
              for r in results]
    bars = ax.bar(labels, [r["output_tok_s"] for r in results], color=["#888"] + ["#3a7"] * (len(results) - 1))
    for bar, r in zip(bars, results, strict=True):
        ax.annotate(f"{r['ratio']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Multi-LoRA burst, SmolLM2-135M, rank-16 adapters on all projections\n{machine}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/lora"))
    args = ap.parse_args()
    machine = describe(native.supported_levels()[0])  # the level cpu_isa "auto" builds
    prompts = burst(args.requests, 0)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", None, args.rank, i)))
                    for i in range(max(args.adapters))]
        results = [run_case(n, adapters, prompts, args.max_tokens, args.rank) for n in [0, *args.adapters]]
    for r in results:
        r["ratio"] = r["output_tok_s"] / results[0]["output_tok_s"]
        print(f"{r['adapters']:>3} adapters: {r['output_tok_s']:7.1f} output tok/s  ({r['ratio']:.2f}x base)")
    print(f"machine: {machine}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "lora.json").write_text(json.dumps({"machine": machine, "requests": args.requests,
                                                        "max_tokens": args.max_tokens, "rank": args.rank,
                                                        "results": results}, indent=1))
    plot(results, machine, args.out_dir / "lora.png")


if __name__ == "__main__":
    main()
