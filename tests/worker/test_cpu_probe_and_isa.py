"""cpu_ops="auto"'s start-up probe and the cpu_isa setting: the choice between the C kernels and torch follows
the probe's figures (a stand-in probe decides here; the real one runs once), cpu_isa reaches every C kernel a
model runs (linear layers, norms, attention, the layer driver), is reported, and a model on each ISA build this
CPU runs gives HF transformers' greedy tokens."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from family_testlib import load_hf, make_family_model, prompts
from worker_testlib import hf_greedy, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu import ops as cpu_ops
from cbserve.worker.cpu import probe as cpu_probe
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.probe import ProbeResult, probe_cached, probe_linear, verdict_path
from cbserve.worker.runner.executor import LocalExecutor

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
CPU = torch.device("cpu")


def _result(native_ms: tuple[float, float], torch_ms: tuple[float, float]) -> ProbeResult:
    return ProbeResult((192, 64), (1, 128), native_ms, torch_ms, "onednn")


def test_the_probe_decides_by_the_geometric_mean_of_its_ratios() -> None:
    assert _result((0.5, 10.0), (1.0, 8.0)).native_wins  # 2x faster decode, 1.25x slower prefill
    assert not _result((0.5, 30.0), (1.0, 10.0)).native_wins  # 3x slower prefill outweighs it
    assert _result((1.0, 1.0), (1.0, 1.0)).native_wins  # a tie keeps the C kernels
    assert _result((1.1, 1.1), (1.0, 1.0)).native_wins  # so does 10% slower: within the noise margin
    assert not _result((1.3, 1.3), (1.0, 1.0)).native_wins
    r = _result((2.0, 2.0), (1.0, 1.0))
    assert r.ratio == pytest.approx(2.0) and r.as_dict()["native_wins"] is False
    assert "1 row: 2.000 vs 1.000 ms" in r.summary() and "ratio 2.00" in r.summary()


@pytest.mark.parametrize("wins", [True, False])
def test_auto_follows_a_stand_in_probe(wins: bool, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    seen = []

    def stand_in(kernels: CpuKernels, hidden: int, inter: int, bf16: bool) -> ProbeResult:
        seen.append((kernels.isa, hidden, inter, bf16))
        return _result((1.0, 1.0), (2.0, 2.0)) if wins else _result((2.0, 2.0), (1.0, 1.0))

    monkeypatch.setattr(cpu_ops, "probe_cached", stand_in)
    with caplog.at_level(logging.INFO, logger="cbserve.worker.cpu.ops"):
        ops = cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar", (64, 96))
    assert seen == [("scalar", 64, 96, False)]  # the requested build is the one probed
    assert ops.mode == ("native" if wins else "onednn") and ops.probe is not None
    assert (ops.kernels is not None) is wins
    report = ops.report()
    assert report["cpu_ops"] == ops.mode and report["cpu_ops_probe"]["native_wins"] is wins
    assert report["cpu_isa"] == ("scalar" if wins else None)
    assert any(("slower on this CPU" in r.getMessage()) is (not wins) for r in caplog.records)
    # "native" is never second-guessed, and without the model's shapes nothing is probed
    assert cpu_ops.resolve_cpu_ops("native", CPU, torch.float32, "scalar", (64, 96)).mode == "native"
    assert cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar").probe is None
    assert len(seen) == 1


def test_the_real_probe_times_both_paths(kernels: CpuKernels) -> None:
    r = probe_linear(kernels, 64, 96)
    assert r.shape == (192, 64) and r.rows == (1, 128)
    assert all(t > 0 for t in (*r.native_ms, *r.torch_ms))
    assert r.torch_path in ("onednn", "torch")
    assert probe_linear(kernels, 64, 4096).shape == (2048, 64)  # the probe's weight stays small


def test_a_verdict_is_taken_once_per_machine_and_shared(kernels: CpuKernels, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas starting together on one machine take one verdict: the first probes under the lock, the others
    read what it kept (so every replica runs the same path); a damaged file is probed again."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    lib = CpuKernels(Path(shutil.copy(kernels.path, tmp_path / kernels.path.name)), isa=kernels.isa)
    calls = []

    def counted(*args: object) -> ProbeResult:
        calls.append(args)
        return probe_linear(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_probe, "probe_linear", counted)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: probe_cached(lib, 64, 96), range(4)))
    assert len(calls) == 1 and all(r == results[0] for r in results)
    path = verdict_path(lib, 64, 96, False)
    assert path.parent == tmp_path and ProbeResult.from_dict(json.loads(path.read_text())) == results[0]
    assert probe_cached(lib, 64, 128) != results[0] and len(calls) == 2  # another shape: its own verdict
    path.write_text("{not json")
    again = probe_cached(lib, 64, 96)
    assert len(calls) == 3 and again != results[0] and probe_cached(lib, 64, 96) == again


def test_cpu_isa_is_validated() -> None:
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        ModelConfig(cpu_isa="avx9", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not run"):
        ModelConfig(cpu_isa="avx2", cpu_ops="torch", device="cpu")
    from cbserve.config import CBServeConfig

    assert CBServeConfig(cpu_isa="scalar", device="cpu").worker_model_config().cpu_isa == "scalar"


def test_a_level_the_cpu_lacks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "supported_levels", lambda flags=None: ("scalar",))
    with pytest.raises(ValueError, match="this CPU runs only scalar"):
        cpu_ops.resolve_cpu_ops("native", CPU, torch.float32, "avx2")


@pytest.fixture(scope="module", params=["mistral", "gemma2"])
def tiny_hd64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """head_dim 64: the attention kernel's specialised path (SmolLM2's head size), GQA 4:2."""
    folder = make_family_model(tmp_path_factory.mktemp(request.param), request.param, {"head_dim": 64})
    return folder, load_hf(folder)


@pytest.mark.parametrize("isa", cpu_native.supported_levels())
def test_every_isa_build_generates_hf_greedy_tokens(tiny_hd64: tuple, isa: str) -> None:
    folder, hf = tiny_hd64
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts(4))]
    cfg = ModelConfig(model=str(folder), cpu_ops="native", cpu_isa=isa, device="cpu")
    executor = LocalExecutor(dataclasses.replace(cfg, block_size=4), num_blocks=64, progress=False)
    runner = executor.runner
    assert runner.cpu_report["cpu_isa"] == isa and runner.model.native_layers is not None
    attn = runner.model.model.layers[0].self_attn.attn
    assert attn._kernels.isa == isa  # the attention kernel is the model's build too
    run = run_engine(executor, reqs, block_size=4, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    for rid, prompt, _ in reqs:
        assert run.tokens[rid][0] == hf_greedy(hf, prompt, 12), (isa, rid)
