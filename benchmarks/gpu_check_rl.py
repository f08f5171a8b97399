"""``make gpu-check`` part 1's RL sub-step (``rl``): the rollout controls' CUDA half on one runner of a tiny random
Llama (``worker_testlib.make_tiny_model``; no Ray, no tokenizer), with CUDA graphs and a KV cache of ``KV_BYTES``:

- sleep level 1: the device memory it gives back (what this process's CUDA allocator holds from the driver,
  ``torch.cuda.memory_reserved``, before against after: the part's cuda tests run beside it in another process, so
  the device's free bytes would count theirs) over the KV cache's bytes (goal >= 0.9), then wake_up's seconds
  (goal < 2 s);
- sleep level 2 (the weights too) and wake_up, the weights reloaded from the folder;
- a weight update of every tensor (scaled and shifted, so each really changes), in place;
- after each, the engine's greedy tokens (through ``run_engine``: chunked prefill, preemption, prefix hits) against
  HF transformers' on the same GPU with the same weights.

A dry run does the same on the CPU with a small cache (the memory given back is the process's RSS there).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_correctness import ENGINE, MAX_NEW, hf_greedy

KV_BYTES = {False: 1 << 30, True: 8 << 20}  # the KV cache: 1 GiB on the GPU, 8 MiB in a dry run
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37], [3, 6, 9, 12, 15, 18], [100, 90, 80, 70, 60, 50, 40]]


def _held_bytes(device: str) -> int | None:
    return int(torch.cuda.memory_reserved()) if device == "cuda" else None


def _engine_tokens(executor: Any, block_size: int, num_blocks: int) -> list[list[int]]:
    from worker_testlib import run_engine

    from cbserve.scheduler.requests.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(PROMPTS)]
    engine = {k: v for k, v in ENGINE.items() if k not in ("block_size", "num_blocks")}
    run = run_engine(executor, reqs, block_size=block_size, num_blocks=num_blocks, **engine)
    return [run.tokens[r][0] for r, _, _ in reqs]


def _freed(device: str, before: int | None, report: dict[str, Any]) -> int:
    """Bytes given back: the CUDA allocator's reserved bytes before against after, else the report's RSS delta."""
    after = _held_bytes(device)
    return before - after if before is not None and after is not None else int(report.get("rss_freed") or 0)


def _perturbed(hf: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the HF model scaled and shifted (seeded): new weights, as a trainer's step makes them."""
    gen = torch.Generator().manual_seed(54)
    state = {}
    for name, t in hf.state_dict().items():
        noise = torch.randn(t.shape, generator=gen).to(t.device, t.dtype)
        state[name] = (t * 1.05 + 0.02 * noise).contiguous()
    hf.load_state_dict(state)
    return state


def rl_controls(device: str, dry_run: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from worker_testlib import make_tiny_model

    from cbserve.worker.config import ModelConfig
    from cbserve.worker.loading.sleep_mode import kv_nbytes
    from cbserve.worker.runner.executor import LocalExecutor

    block_size = 16
    with tempfile.TemporaryDirectory(prefix="cbserve-gpu-check-rl-") as tmp:
        folder = make_tiny_model(Path(tmp) / "llama", "llama_gqa")
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device).eval()
        cfg = ModelConfig(model=str(folder), dtype="float32", device=device, enforce_eager=dry_run,
                          max_model_len=256, block_size=block_size, max_num_batched_tokens=16,
                          max_num_seqs=4)  # fmt: skip
        probe = LocalExecutor(cfg, num_blocks=4, progress=False)
        per_block = kv_nbytes(probe.runner.kv_caches) // 4
        probe.shutdown()
        num_blocks = KV_BYTES[dry_run] // per_block
        executor = LocalExecutor(cfg, num_blocks=num_blocks, progress=False)
        try:
            return _controls(executor, hf, device, block_size, num_blocks)
        finally:
            executor.shutdown()


def _controls(executor: Any, hf: Any, device: str, block_size: int, num_blocks: int) -> dict[str, Any]:
    runner = executor.runner
    reference = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    out: dict[str, Any] = {"kv_cache_bytes": None, "num_blocks": num_blocks, "device": device}
    out["greedy_equal_before"] = _engine_tokens(executor, block_size, num_blocks) == reference
    for level in (1, 2):
        before = _held_bytes(device)
        t0 = time.perf_counter()
        report = runner.sleep(level)
        sleep_s = time.perf_counter() - t0
        freed = _freed(device, before, report)
        t0 = time.perf_counter()
        runner.wake_up()
        wake_s = time.perf_counter() - t0
        out[f"level{level}"] = {"sleep_s": round(sleep_s, 4), "wake_up_s": round(wake_s, 4), "freed_bytes": freed,
                                "kv_cache_bytes": report["kv_cache_bytes"], "weight_bytes": report["weight_bytes"],
                                "greedy_equal_after_wake": _engine_tokens(executor, block_size, num_blocks)
                                == reference}  # fmt: skip
    out["kv_cache_bytes"] = out["level1"]["kv_cache_bytes"]
    out["level1_freed_over_kv"] = round(out["level1"]["freed_bytes"] / max(1, out["kv_cache_bytes"]), 3)
    state = _perturbed(hf)
    t0 = time.perf_counter()
    update = runner.update_weights(state.items())
    out["update"] = {"seconds": round(time.perf_counter() - t0, 4), "num_bytes": update["num_bytes"],
                     "repacked": update["repacked"]}  # fmt: skip
    new_reference = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    out["update"]["weights_changed_tokens"] = new_reference != reference
    out["update"]["greedy_equal"] = _engine_tokens(executor, block_size, num_blocks) == new_reference
    return out
