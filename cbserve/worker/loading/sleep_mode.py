"""Sleep and wake for one worker's ``ModelRunner`` (vLLM's semantics), to hand the machine's memory to an RL
trainer between rollouts.

- ``sleep(level=1)``: the KV cache is freed (the weights stay): the cache tensors, the CUDA graphs captured over
  them, the draft model's cache, the KV tiers' registration (the tiers themselves, host RAM below the pool, stay).
  The requests the worker held are dropped: their cached tokens are gone (the scheduler must not keep requests or
  prefix-cache hits across a sleep). The memory then goes back to the system: ``gc.collect()``, then
  ``malloc_trim(0)`` on CPU (glibc; large tensors are mmap'd and return at free anyway) or
  ``torch.cuda.empty_cache()`` on CUDA.
- ``sleep(level=2)``: the weights are freed too (every parameter emptied, packed copies and the C layer driver
  dropped; the draft model keeps its own). Refused (ValueError) for a runner built with explicit ``weights=``:
  there is nothing to reload them from.
- ``wake_up(tags)``: ``tags`` within {"weights", "kv_cache"}, None for both. "weights" reloads them from the model
  folder exactly as ``build_model`` loaded them (FP8 quantization, the CPU packing with the GGUF blocks where
  compact): a trainer then pushes its own with ``update_weights``. "kv_cache" allocates the same number of blocks
  again (zeros), registers them with the tiers and captures the CUDA graphs again; it needs the weights awake.

Sleeping again at a level already reached, or waking what is awake, is a no-op whose report says so;
``execute_model`` while asleep raises RuntimeError. Reports give the bytes released and the process's resident
memory (``VmRSS`` of /proc/self/status) before and after.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from cbserve.worker.cpu.linear import RegimeWeight
from cbserve.worker.cpu.malloc import malloc_trim
from cbserve.worker.cpu.probe import proc_bytes
from cbserve.worker.layers.moe import SparseMoeBlock
from cbserve.worker.loading.model_build import place_weights
from cbserve.worker.loading.model_loader import iter_weights
from cbserve.worker.loading.weight_update import dense_shape, owner_of

TAGS = ("weights", "kv_cache")


def rss_bytes() -> int | None:
    """This process's resident memory (VmRSS), None where /proc is not there."""
    return proc_bytes("/proc/self/status", "VmRSS")


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        malloc_trim()


def kv_nbytes(kv_caches: Iterable[Any]) -> int:
    """Bytes of a KV cache's tensors (an FP8 cache's scales included)."""
    total = 0
    for kv in kv_caches:
        for t in (*kv, *(getattr(kv, a) for a in ("k_scale", "v_scale") if hasattr(kv, a))):
            total += t.numel() * t.element_size()
    return total


def packed_nbytes(packed: Any) -> int:
    """Bytes a packed weight holds (panels, FP8 values and scales, torch's copies)."""
    if isinstance(packed, RegimeWeight):
        return packed_nbytes(packed.few) + packed_nbytes(packed.many)
    panels = getattr(packed, "panels", None)
    if panels is not None:
        return int(panels.nbytes)
    tensors = [t for t in vars(packed).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def release_model_weights(model: Any) -> tuple[dict[str, tuple[int, ...]], int]:
    """Free every weight of ``model``: parameters emptied, packed copies and the C layer driver dropped. Returns the
    parameters' dense shapes (for ``reload_model_weights``) and the bytes released."""
    shapes: dict[str, tuple[int, ...]] = {}
    nbytes = 0
    for name, param in model.named_parameters():  # a tied parameter once
        owner, attr = owner_of(model, name)
        shapes[name] = dense_shape(model, owner, attr, param)
        nbytes += param.numel() * param.element_size()
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    for m in model.modules():
        if getattr(m, "packed", None) is not None:
            nbytes += packed_nbytes(m.packed)
            m.packed = None
        if isinstance(m, SparseMoeBlock):
            m._stacked = None
    model.native_layers = None
    return shapes, nbytes


def reload_model_weights(model: Any, folder: Path, shapes: Mapping[str, tuple[int, ...]], config: Any,
                         device: torch.device) -> None:
    """The weights ``release_model_weights`` freed, loaded again from ``folder`` as ``build_model`` places them."""
    with torch.no_grad():
        for name, shape in shapes.items():
            param = model.get_parameter(name)
            param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
    place_weights(model, iter_weights(folder, progress=False), folder, config, device)


class SleepMode:
    """One runner's sleep state: what is released (``asleep``: tags), and what waking needs."""

    def __init__(self, reloadable: bool) -> None:
        self.reloadable = reloadable  # weights from the model folder (not given as ``weights=``)
        self.asleep: set[str] = set()
        self.num_blocks = 0  # the KV cache's blocks when it was released
        self.shapes: dict[str, tuple[int, ...]] = {}  # the released parameters' dense shapes

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_awake(self, what: str) -> None:
        if self.asleep:
            raise RuntimeError(
                f"the worker is asleep ({' and '.join(sorted(self.asleep))} released by sleep()): "
                f"call wake_up() before {what}"
            )

    def check_weights(self, what: str) -> None:
        if "weights" in self.asleep:
            raise RuntimeError(f"the weights were released by sleep(level=2): call wake_up(['weights']) before {what}")

    def sleep(self, runner: Any, level: int) -> dict[str, Any]:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (also the weights), got {level!r}")
        new = [t for t in (("kv_cache", "weights") if level == 2 else ("kv_cache",)) if t not in self.asleep]
        report: dict[str, Any] = {"level": level, "released": new, "kv_cache_bytes": 0, "weight_bytes": 0}
        if not new:
            return {**report, "note": "already asleep at this level: nothing released"}
        if "weights" in new and not self.reloadable:
            raise ValueError(
                "sleep(level=2) releases the weights, but this runner was built with weights= given, "
                "not from its model folder: nothing to reload them from on wake_up (use level 1)"
            )
        rss, t0 = rss_bytes(), time.perf_counter()
        if "kv_cache" in new:
            report["kv_cache_bytes"] = self._release_kv(runner)
        if "weights" in new:
            self.shapes, report["weight_bytes"] = release_model_weights(runner.model)
        self.asleep.update(new)
        release_memory(runner.device)
        return {**report, **_memory(rss, t0), "bytes_freed": report["kv_cache_bytes"] + report["weight_bytes"]}

    def _release_kv(self, runner: Any) -> int:
        runner.drop(set(runner.requests))  # their tokens' KV is gone
        draft = runner.draft
        nbytes = kv_nbytes(runner.kv_caches) + (kv_nbytes(draft.kv_caches) if draft is not None else 0)
        self.num_blocks = runner.num_blocks if runner.kv_caches else 0
        runner.graphs = runner.piecewise = None  # captured over the cache (and the weights)
        runner.kv_caches = []
        if runner.kv_tiers is not None:
            runner.kv_tiers.register_kv_caches([])
        if draft is not None:
            draft.kv_caches = []
        return nbytes

    def wake_up(self, runner: Any, tags: Iterable[str] | None) -> dict[str, Any]:
        wanted = set(TAGS) if tags is None else {tags} if isinstance(tags, str) else set(tags)
        unknown = wanted - set(TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tag(s) {sorted(unknown)}: use {list(TAGS)} (None: both)")
        todo = [t for t in TAGS if t in wanted and t in self.asleep]  # the weights first
        if not todo:
            return {"woken": [], "note": "already awake: nothing to do"}
        if todo == ["kv_cache"] and "weights" in self.asleep:
            raise ValueError(
                "wake_up(['kv_cache']) while the weights sleep: wake the weights first (the KV cache's "
                "CUDA graphs are captured over them)"
            )
        rss, t0 = rss_bytes(), time.perf_counter()
        if "weights" in todo:
            reload_model_weights(runner.model, runner.model_folder, self.shapes, runner.config, runner.device)
            self.asleep.discard("weights")
            self.shapes = {}
        if "kv_cache" in todo:
            if self.num_blocks:
                runner.init_kv_cache(self.num_blocks)
            self.asleep.discard("kv_cache")
        return {"woken": todo, "num_blocks": self.num_blocks, **_memory(rss, t0)}


def _memory(rss_before: int | None, t0: float) -> dict[str, Any]:
    after = rss_bytes()
    freed = rss_before - after if rss_before is not None and after is not None else None
    return {"rss_before": rss_before, "rss_after": after, "rss_freed": freed, "seconds": time.perf_counter() - t0}
