"""ModelRunner.sleep / wake_up (cbserve/worker/loading/sleep_mode.py): level 1 gives the KV cache's memory back to the
system and wakes to the same outputs; level 2 also frees the weights and wakes with the folder's weights (compact
GGUF blocks included); misuse is refused with a clear error."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from test_weight_update import greedy, make_q8_folder, make_runner, needs_cc, random_hf

from cbserve.scheduler.outputs import NewRequestData, SchedulerOutput
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.cpu.linear import native_weight
from cbserve.worker.loading.sleep_mode import rss_bytes

KV_BYTES = 256 << 20  # dominates the process's other allocations between two VmRSS readings


@pytest.fixture(scope="module")
def q8_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_q8_folder(tmp_path_factory.mktemp("q8"))


def _one_step() -> SchedulerOutput:
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    return SchedulerOutput([NewRequestData("s", [3, 4, 5], 3, sp, [0], 0)], [], {"s": 3}, 3)


@pytest.mark.parametrize("cpu_ops", ["torch", pytest.param("native", marks=needs_cc)])
def test_level_1_gives_the_kv_cache_back_and_wakes_to_the_same_outputs(gqa: Path, cpu_ops: str) -> None:
    runner = make_runner(gqa, cpu_ops, num_blocks=None, kv_cache_memory_bytes=KV_BYTES, kv_offloading_bytes=1 << 20)
    num_blocks, before = runner.num_blocks, greedy(runner)
    runner.execute_model(_one_step())  # a request held across the sleep: dropped with its KV
    gc.collect()
    rss = rss_bytes()
    report = runner.sleep(1)
    freed = rss - rss_bytes()
    kv = report["kv_cache_bytes"]
    assert KV_BYTES * 0.99 <= kv <= KV_BYTES and report["weight_bytes"] == 0 and report["released"] == ["kv_cache"]
    assert freed >= 0.9 * kv, f"VmRSS fell by {freed / 2**20:.0f} MiB of a {kv / 2**20:.0f} MiB KV cache"
    assert report["rss_freed"] >= 0.9 * kv
    assert runner.is_sleeping and runner.kv_caches == [] and runner.requests == {}
    assert runner.kv_tiers is not None and runner.kv_tiers.kv_caches == []  # the tiers stay, unregistered
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache released by sleep\(\)\): call wake_up\(\)"):
        runner.execute_model(_one_step())
    woken = runner.wake_up()
    assert woken["woken"] == ["kv_cache"] and woken["rss_after"] - woken["rss_before"] >= 0.9 * kv
    assert not runner.is_sleeping and runner.num_blocks == num_blocks
    assert runner.kv_tiers.kv_caches is runner.kv_caches
    assert greedy(runner) == before


@pytest.mark.parametrize(
    "cpu_ops,variant", [pytest.param("native", "q8_folder", marks=needs_cc), ("torch", "tied"), ("onednn", "gqa")]
)
def test_level_2_wakes_with_the_folders_weights(cpu_ops: str, variant: str, request: pytest.FixtureRequest) -> None:
    if cpu_ops == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    folder = request.getfixturevalue(variant)
    runner = make_runner(folder, cpu_ops)
    model = runner.model
    before = greedy(runner)
    _, new = random_hf(folder, seed=21)
    runner.update_weights(new.items())  # a trainer's weights: level 2 drops them, the wake reads the folder's
    assert greedy(runner) != before
    report = runner.sleep(2)
    assert report["released"] == ["kv_cache", "weights"] and report["weight_bytes"] > 0
    assert all(p.numel() == 0 for p in model.parameters()) and model.native_layers is None
    assert all(getattr(m, "packed", None) is None for m in model.modules())
    with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) before update_weights"):
        runner.update_weights(new.items())
    with pytest.raises(ValueError, match="wake the weights first"):
        runner.wake_up(["kv_cache"])
    assert runner.wake_up(["weights"])["woken"] == ["weights"]
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache released"):
        runner.execute_model(_one_step())
    if cpu_ops == "native":  # packed from the GGUF blocks again, as a fresh load packs them
        assert native_weight(model.model.layers[1].mlp.gate_up_proj.packed).panels.fmt in ("q8_0", "q8_0_i16all")
        assert model.native_layers is not None
    assert runner.wake_up(["kv_cache"])["woken"] == ["kv_cache"]
    assert greedy(runner) == before


def test_repeated_calls_are_no_ops_and_bad_arguments_are_refused(gqa: Path) -> None:
    runner = make_runner(gqa, "torch")
    before = greedy(runner)
    assert runner.wake_up()["woken"] == [] and not runner.is_sleeping  # awake: nothing to do
    for level in (0, 3, "1"):
        with pytest.raises(ValueError, match="sleep level must be 1"):
            runner.sleep(level)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unknown wake_up tag\(s\) \['kv'\]"):
        runner.wake_up(["weights", "kv"])
    assert runner.sleep(1)["released"] == ["kv_cache"]
    again = runner.sleep(1)
    assert again["released"] == [] and "already asleep" in again["note"] and runner.is_sleeping
    assert runner.sleep(2)["released"] == ["weights"]  # level 2 after level 1: the weights too
    assert runner.sleep(1)["released"] == [] and runner.sleep(2)["released"] == []
    assert runner.wake_up("weights")["woken"] == ["weights"]
    assert runner.wake_up(["weights"])["woken"] == []
    assert runner.wake_up()["woken"] == ["kv_cache"] and not runner.is_sleeping
    assert greedy(runner) == before


def test_level_2_is_refused_without_a_folder_to_reload_from(gqa: Path) -> None:
    _, new = random_hf(gqa, seed=4)
    runner = make_runner(gqa, "torch", weights=new.items())
    before = greedy(runner)
    with pytest.raises(ValueError, match="built with weights= given"):
        runner.sleep(2)
    assert not runner.is_sleeping and greedy(runner) == before  # nothing released
    runner.sleep(1)
    with pytest.raises(ValueError, match="nothing to reload"):
        runner.sleep(2)
    runner.wake_up()
    assert greedy(runner) == before


def test_update_while_the_kv_cache_sleeps(gqa: Path) -> None:
    """The RL loop: sleep(1) while the trainer runs, push its weights, wake: the new weights' outputs."""
    _, new = random_hf(gqa, seed=8)
    runner = make_runner(gqa, "torch")
    runner.sleep(1)
    runner.update_weights(new.items())
    runner.wake_up()
    assert greedy(runner) == greedy(make_runner(gqa, "torch", weights=new.items()))


def test_the_draft_models_cache_sleeps_too(gqa: Path) -> None:
    runner = make_runner(gqa, "torch", draft_model=str(gqa), num_speculative_tokens=2)
    draft = runner.draft
    assert draft is not None
    size = [tuple(k.shape) for k, _ in draft.kv_caches]
    nbytes = sum(t.numel() * t.element_size() for kv in [*runner.kv_caches, *draft.kv_caches] for t in kv)
    before = greedy(runner)
    report = runner.sleep(1)
    assert draft.kv_caches == [] and report["kv_cache_bytes"] == nbytes
    runner.wake_up()
    assert [tuple(k.shape) for k, _ in draft.kv_caches] == size and greedy(runner) == before
