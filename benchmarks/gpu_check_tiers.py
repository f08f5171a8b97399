"""``make gpu-check`` part 1's KV-tiers sub-step (``kv_tiers``): the RAM tier below the pool on the GPU, in pinned host
memory (worker/kv/tiers.py: the same code as on CPU), on a tiny random Llama
(``worker_testlib.make_tiny_model``) whose pool holds fewer blocks than its conversations: turn 1 of every
conversation, then turn 2 (turn 1 + more tokens), whose prefixes the pool evicted. Recorded: the greedy tokens of
both turns against the same engine without tiers (equal: the tier keeps the cache's dtype), the tier's hit tokens,
and the bytes moved pool -> pinned RAM and back with their GB/s (the worker's own copy times). A dry run does the
same on the CPU (unpinned)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from gpu_check_correctness import MAX_NEW

BLOCK = 16
CONVERSATIONS = 8
PROMPT = 96  # tokens of turn 1: 6 full blocks
POOL_BLOCKS = 24  # fewer than the conversations' 8 x 7 blocks
RAM_BYTES = {False: 256 << 20, True: 4 << 20}


def _turns() -> tuple[list[list[int]], list[list[int]]]:
    first = [[1 + (37 * c + i) % 300 for i in range(PROMPT)] for c in range(CONVERSATIONS)]
    return first, [p + [5, 6, 7, 8, 9] for p in first]


def _engine_turns(folder: Path, device: str, ram_bytes: int) -> tuple[list[list[int]], dict[str, Any]]:
    """Both turns through one engine (its tiers' index lives in its scheduler): the tokens, the tier's counters."""
    from cbserve.scheduler import CacheConfig, EngineConfig, EngineCore, EngineRequest, SchedulerConfig
    from cbserve.scheduler.requests.sampling_params import SamplingParams
    from cbserve.worker.config import ModelConfig
    from cbserve.worker.runner.executor import LocalExecutor

    cfg = ModelConfig(model=str(folder), dtype="float32", device=device, enforce_eager=True, max_model_len=256,
                      block_size=BLOCK, max_num_batched_tokens=256, max_num_seqs=4,
                      kv_offloading_bytes=ram_bytes)  # fmt: skip
    executor = LocalExecutor(cfg, num_blocks=POOL_BLOCKS, progress=False)
    try:
        tiers = executor.runner.kv_tiers
        if tiers is not None:
            tiers.whole_blocks = True  # the CUDA path's moves, in a dry run too
        engine = EngineCore(EngineConfig(
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256),
            cache=CacheConfig(block_size=BLOCK, num_blocks=POOL_BLOCKS, offload=tiers.config if tiers else None),
        ), executor)  # fmt: skip
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        for turn, prompts in enumerate(_turns()):
            for i, p in enumerate(prompts):
                tokens[f"t{turn}-{i}"] = []
                engine.add_request(EngineRequest(f"t{turn}-{i}", p, greedy, eos_token_id=2))
            while engine.has_work():
                for out in engine.step_with_batch_queue().outputs:
                    tokens[out.req_id] += out.new_token_ids
        offload = engine.scheduler.offload
        pinned = bool(tiers is not None and device == "cuda" and tiers.slots.is_pinned())
        return list(tokens.values()), {"pinned": pinned, "stats": vars(offload.stats) if offload else None}
    finally:
        executor.shutdown()


def kv_tiers_on_device(device: str, dry_run: bool) -> dict[str, Any]:
    from worker_testlib import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="cbserve-gpu-check-tiers-") as tmp:
        folder = make_tiny_model(Path(tmp) / "llama", "llama_gqa")
        reference, _ = _engine_turns(folder, device, 0)
        tokens, info = _engine_turns(folder, device, RAM_BYTES[dry_run])
    s = info["stats"] or {}
    out: dict[str, Any] = {"device": device, "pinned": info["pinned"], "tokens_equal": tokens == reference,
                           "pool_blocks": POOL_BLOCKS, **s}  # fmt: skip
    for way, (nbytes, secs) in {"store": ("bytes_stored", "store_s"), "load": ("bytes_loaded", "load_s")}.items():
        out[f"{way}_gb_per_s"] = round(s[nbytes] / s[secs] / 1e9, 3) if s.get(secs) else None
    out["real_size_blocks"] = tier_copy_bandwidth(device, dry_run)
    return out


def tier_copy_bandwidth(device: str, dry_run: bool) -> dict[str, Any]:
    """The worker's store and load of real-size blocks (Llama-3.1-8B's: 32 layers x K/V x 16 tokens x 8 heads x 128,
    bfloat16, 2 MiB a block; a dry run: tiny ones), 64 at once, between the device's cache and the RAM tier
    (pinned on CUDA): seconds and GB/s of each (the median of 5, after a warm-up), and the loaded blocks checked
    equal to the stored ones."""
    import statistics
    import time

    import torch

    from cbserve.scheduler.kv.connector import KVTransfer
    from cbserve.worker.kv.tiers import KVTiers

    layers, heads, dim, n = (2, 2, 16, 8) if dry_run else (32, 8, 128, 64)
    shape, dtype = (layers, 2, BLOCK, heads, dim), torch.bfloat16
    block_bytes = layers * 2 * BLOCK * heads * dim * 2
    tiers = KVTiers(n * block_bytes, None, 0, shape, dtype, pin=device == "cuda")
    tiers.whole_blocks = True  # the CUDA path's moves, in a dry run too
    caches = [tuple(torch.randn(2 * n, BLOCK, heads, dim, device=device).to(dtype) for _ in range(2))
              for _ in range(layers)]  # fmt: skip
    tiers.register_kv_caches(caches)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"store": [], "load": []}
    for rep in range(6):
        hashes = [10_000 * rep + i for i in range(n)]
        for way, transfer in (("store", KVTransfer(stores=list(enumerate(hashes)))),
                              ("load", KVTransfer(loads=[(n + i, h) for i, h in enumerate(hashes)]))):  # fmt: skip
            sync()
            t0 = time.perf_counter()
            tiers.start_load_kv(transfer)
            sync()
            times[way].append(time.perf_counter() - t0)
        tiers.start_load_kv(KVTransfer(evict=hashes))
    equal = all(torch.equal(k[:n], k[n:]) and torch.equal(v[:n], v[n:]) for k, v in caches)
    tiers.shutdown()
    nbytes = n * tiers.block_bytes
    out: dict[str, Any] = {"block_bytes": tiers.block_bytes, "blocks": n, "pinned": bool(tiers.slots.is_pinned()),
                           "loaded_equal_stored": equal}  # fmt: skip
    for way, ts in times.items():
        med = statistics.median(ts[1:])
        out[f"{way}_s"], out[f"{way}_gb_per_s"] = round(med, 5), round(nbytes / med / 1e9, 2)
    return out
