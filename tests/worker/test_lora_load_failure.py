"""An adapter that fails on the worker fails alone (``LoRAManager``, worker/lora/manager.py): its content cannot be
fetched
from the source, is not the content checked (its digest), or does not fit its slot halfway through being written;
each raises ``AdapterLoadError`` naming its ``lora_int_id``, leaves every slot consistent (a half-written slot
emptied and free) and the LRU without it. After such failures the manager serves the other adapters exactly as a
fresh one does: the same slots' contents, the same LRU, and a generate with them gives PEFT's tokens. A manager
with a source runs the checked bytes, whatever happened to the files since."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_testlib import make_adapter, peft_greedy, peft_model
from test_lora import PATHS, PROMPTS, _base

from cbserve import LLM, LoRARequest, SamplingParams
from cbserve.frontend.lora_contents import LocalAdapters
from cbserve.worker.lora.files import AdapterLoadError, LoRAAdapterError
from cbserve.worker.lora.manager import LoRAManager

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[LoRARequest], LLM]:
    root = tmp_path_factory.mktemp("lora_fail")
    base = _base(root / "base", "llama")
    adapters = [LoRARequest(n, i, str(make_adapter(base, root / n, i, r=4 * i))) for i, n in enumerate("ab", 1)]
    adapters.append(LoRARequest("bad", 3, str(make_adapter(base, root / "bad", 3, r=4))))
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8, progress=False,
              **PATHS["native"])  # fmt: skip
    return base, adapters, llm


class Source:
    """The LLM's kept bytes, except for the adapters told to fail (as a store that cannot be reached)."""

    def __init__(self, kept: LocalAdapters) -> None:
        self.kept = kept
        self.failing: set[int] = set()  # ids whose fetch fails
        self.other: set[int] = set()  # ids that get other bytes than those checked

    def __call__(self, lora: LoRARequest) -> tuple[bytes, bytes]:
        if lora.lora_int_id in self.failing:
            raise ConnectionError("the adapter store is unreachable")
        config, weights = self.kept(lora)
        return (config, weights + b" ") if lora.lora_int_id in self.other else (config, weights)


def _manager(llm: LLM, source: Source) -> LoRAManager:
    """A manager over the LLM's model (it takes the model's layers over), serving in the LLM's place."""
    runner = llm.executor.runner
    manager = LoRAManager(runner.model, runner.hf_config, 2, 8, 3, runner.dtype, runner.device, source=source)
    runner.lora = manager
    return manager


def _state(manager: LoRAManager) -> dict[str, Any]:
    """What a manager serves, whatever its slots' order: each adapter's columns in every layer, and the LRU."""
    slots = {}
    for slot, lid in enumerate(manager.slots):
        if lid is not None:
            slots[lid] = [(s.a[slot].clone(), s.b[slot].clone(), s.used[slot]) for _, s in manager.linears.values()]
    return {"slots": slots, "lru": sorted(manager.cache)}


def _same(one: dict[str, Any], two: dict[str, Any]) -> bool:
    if one["lru"] != two["lru"] or one["slots"].keys() != two["slots"].keys():
        return False
    layers = [pair for lid in one["slots"] for pair in zip(one["slots"][lid], two["slots"][lid], strict=True)]
    return all(torch.equal(a1, a2) and torch.equal(b1, b2) and u1 == u2 for (a1, b1, u1), (a2, b2, u2) in layers)


def test_failed_loads_leave_the_manager_as_a_fresh_one(case: tuple) -> None:
    base, (a, b, bad), llm = case
    checked = llm._adapters.check([a, b, bad])  # the digests of the bytes the LLM checked and keeps
    ca, cb, cbad = checked[a], checked[b], checked[bad]
    source = Source(llm._adapters)
    manager = _manager(llm, source)
    manager.prepare_step([ca], [3])
    source.failing.add(bad.lora_int_id)
    with pytest.raises(AdapterLoadError, match="unreachable") as unreachable:
        manager.prepare_step([ca, cbad], [2, 2])
    assert unreachable.value.lora_int_id == bad.lora_int_id and manager.slots == [a.lora_int_id, None]
    assert list(manager.cache) == [a.lora_int_id] and manager.step.runs == []
    source.other.add(b.lora_int_id)  # bytes that are not the ones checked
    with pytest.raises(AdapterLoadError, match="not the one checked") as changed:
        manager.prepare_step([cb], [1])
    assert changed.value.lora_int_id == b.lora_int_id and list(manager.cache) == [a.lora_int_id]
    source.other.clear()
    half = _fail_halfway(manager, cb)
    assert half.lora_int_id == b.lora_int_id and list(manager.cache) == [a.lora_int_id]
    assert manager.slots == [a.lora_int_id, None] and manager.linears[(1, "mlp.down_proj")][1].used[1] == 0
    assert all(not s.a[1].any() and not s.b[1].any() for _, s in manager.linears.values())  # emptied, no half
    loras = [None, ca, cb, ca]
    outs = llm.generate(PROMPTS[:4], GREEDY, lora_request=[None, a, b, a], use_tqdm=False)
    after_failures = _state(manager)
    fresh = _manager(llm, Source(llm._adapters))
    again = llm.generate(PROMPTS[:4], GREEDY, lora_request=[None, a, b, a], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again] == _peft(base, loras)
    assert _same(after_failures, _state(fresh)) and len(after_failures["slots"]) == 2
    assert pickle.loads(pickle.dumps(unreachable.value)).lora_int_id == bad.lora_int_id  # crosses Ray intact


def _fail_halfway(manager: LoRAManager, lora: LoRARequest) -> AdapterLoadError:
    """The adapter's slot write raises at the last layer (all the others written): the error raised."""
    last = list(manager.linears.values())[-1][1]
    original = last.load

    def broken(slot: int, weights: Any) -> None:
        if weights is not None:
            raise RuntimeError("the copy failed")
        original(slot, weights)

    last.load = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(AdapterLoadError, match="does not fit its slot") as info:
            manager.prepare_step([lora], [2])
    finally:
        last.load = original  # type: ignore[method-assign]
    return info.value


def _peft(base: Path, loras: list[LoRARequest | None]) -> list[list[int]]:
    models = {x.lora_int_id: peft_model(base, Path(x.lora_path)) for x in loras if x is not None}
    models[0] = peft_model(base, None)
    prompts = PROMPTS[: len(loras)]
    return [peft_greedy(models[0 if x is None else x.lora_int_id], p, 6) for x, p in zip(loras, prompts, strict=True)]


def test_the_checked_bytes_run_whatever_the_files_do_after(case: tuple, tmp_path: Path) -> None:
    """Offline, the LLM keeps the bytes it checked: the adapter's folder deleted after the check, its worker still
    loads it (from the LLM); without a source the worker reads the folder, and refuses a changed one."""
    base, (a, *_), llm = case
    copy = LoRARequest("copy", 7, str(shutil.copytree(a.lora_path, tmp_path / "copy")))
    checked = llm._adapters.check([copy])[copy]
    shutil.rmtree(copy.lora_path)
    manager = _manager(llm, Source(llm._adapters))
    manager.prepare_step([checked], [1])
    weights = manager.cache[copy.lora_int_id]
    reference = _manager(llm, Source(llm._adapters))
    reference.prepare_step([llm._adapters.check([a])[a]], [1])
    assert all(torch.equal(w[0], r[0]) and torch.equal(w[1], r[1])
               for w, r in zip(weights.values(), reference.cache[a.lora_int_id].values(), strict=True))
    no_source = _manager(llm, Source(llm._adapters))
    no_source.source = None
    shutil.copytree(a.lora_path, copy.lora_path)
    (Path(copy.lora_path) / "adapter_model.safetensors").write_bytes(b"\0" * 16)  # changed since it was checked
    with pytest.raises(AdapterLoadError) as info:
        no_source.prepare_step([checked], [1])
    assert info.value.lora_int_id == 7 and no_source.slots == [None, None]
    with pytest.raises(LoRAAdapterError, match="'copy' at .*copy: adapter_model.safetensors is not a safetensors"):
        llm._adapters.check([LoRARequest("copy", 8, copy.lora_path)])  # a new check reads the changed folder


def test_the_requests_of_an_adapter_that_cannot_be_fetched_fail_alone(case: tuple) -> None:
    """Through the engine: the step's ``AdapterLoadError`` fails the requests using that adapter (finish reason
    "error", naming it), the others of the same batch get exactly their tokens of a run without it."""
    _, (a, _, bad), llm = case
    source = Source(llm._adapters)
    source.failing.add(bad.lora_int_id)
    _manager(llm, source)
    reference = llm.generate(PROMPTS[:3], GREEDY, lora_request=[None, a, None], use_tqdm=False)
    outs = llm.generate(PROMPTS[:4], GREEDY, lora_request=[None, a, None, bad], use_tqdm=False)
    failed = outs[3].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == [] and "'bad'" in (failed.error or "")
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in reference]
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
