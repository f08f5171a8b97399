"""cpu_ops="auto" and the cpu_isa setting: the choice between the C kernels and torch follows the probe's figures
for each regime (a stand-in probe decides here; the probe itself is tested in test_cpu_probe.py), cpu_isa reaches
every C kernel a model runs (linear layers, norms, attention, the layer driver), is reported, and a model on each
ISA build this CPU runs gives HF transformers' greedy tokens."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from family_testlib import load_hf, make_family_model, prompts
from worker_testlib import hf_greedy, run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu import ops as cpu_ops
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.probe import ProbeResult, RegimeTiming
from cbserve.worker.runner.executor import LocalExecutor

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")
CPU = torch.device("cpu")
INT16_DECODE = ("int16", "float32")  # cpu_decode_activations, cpu_prefill_activations


def _result(few: tuple[float, float], many: tuple[float, float]) -> ProbeResult:
    """A stand-in verdict: (C kernels, torch) milliseconds for few-row and for many-row products."""
    return ProbeResult((192, 64), "q4_0", "onednn", RegimeTiming(1, *few), RegimeTiming(128, *many), 0.0)


# (few-row figures, many-row figures) -> the mode and the paths cpu_ops "auto" gives the model
CASES = {
    "both native": (((1.0, 2.0), (1.0, 2.0)), "native", ("native", "native")),
    "both torch": (((2.0, 1.0), (2.0, 1.0)), "onednn", ("onednn", "onednn")),
    "decode native, prefill torch": (((1.0, 2.0), (2.0, 1.0)), "native", ("native", "torch")),
    "decode torch, prefill native": (((2.0, 1.0), (1.0, 2.0)), "native", ("torch", "native")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_auto_follows_a_stand_in_probe_per_regime(case: str, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    figures, mode, paths = CASES[case]
    seen = []

    def stand_in(kernels: CpuKernels, hidden: int, inter: int, fmt: str, bf16: bool,
                 int16_rows: bool = False, int16_every_row: bool = False) -> ProbeResult:
        seen.append((kernels.isa, hidden, inter, fmt, bf16) + ((True,) if int16_rows else ())
                    + (("every row",) if int16_every_row else ()))
        return _result(*figures)

    monkeypatch.setattr(cpu_ops, "probe_cached", stand_in)
    with caplog.at_level(logging.INFO, logger="cbserve.worker.cpu.ops"):
        ops = cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar", (64, 96), "q4_0")
    assert seen == [("scalar", 64, 96, "q4_0", False)]  # the requested build and the model's format are probed
    assert ops.mode == mode and ops.probe is not None and (ops.kernels is not None) is (mode == "native")
    report = ops.report()
    assert report["cpu_linear_paths"] == {"few_rows": paths[0], "many_rows": paths[1]}
    few, many = ("native" if native <= other else "torch" for native, other in figures)
    assert report["cpu_ops_probe"]["paths"] == {"few": few, "many": many}
    assert report["cpu_isa"] == ("scalar" if mode == "native" else None)
    assert any(("slower on this CPU" in r.getMessage()) is (case != "both native") for r in caplog.records)
    # mixed paths hold torch's copy of the weights too: not when it would take over half the memory available
    monkeypatch.setattr(cpu_ops, "available_memory_bytes", lambda: 7 * 2**30)
    for values, mixed in ((2 * 2**30, False), (2**28, True)):  # 8 or 1 GiB of float32 weights
        ops = cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar", (64, 96), "q4_0", values)
        held = paths if mixed or "native" not in paths else ("native", "native")
        assert ops.mode == mode and tuple(ops.report()["cpu_linear_paths"].values()) == held
    # "native" is never second-guessed, and without the model's shapes nothing is probed
    assert cpu_ops.resolve_cpu_ops("native", CPU, torch.float32, "scalar", (64, 96)).linear_paths == ("native",) * 2
    assert cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar").probe is None
    assert len(seen) == 3
    # int16 decode activations are probed apart, and refused where decode steps would not run on the C kernels
    if paths[0] == "native" and mode == "native":
        ops = cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar", (64, 96), "q4_0", activations=INT16_DECODE)
        assert ops.int16_rows and ops.report()["cpu_decode_activations"] == "int16"
    else:
        with pytest.raises(ValueError, match="cpu_decode_activations 'int16' needs the C kernels for decode steps"):
            cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar", (64, 96), "q4_0", activations=INT16_DECODE)
    assert seen[-1] == ("scalar", 64, 96, "q4_0", False, True)
    # int16 prefill activations: refused on a build without int16 multiply-adds in one instruction (scalar here),
    # whatever the probe says
    with pytest.raises(ValueError, match="cpu_prefill_activations 'int16' needs int16 multiply-adds in one instr"):
        cpu_ops.resolve_cpu_ops("native", CPU, torch.float32, "scalar", (64, 96), "q4_0",
                                activations=("int16", "int16"))


VNNI, NO_VNNI = SimpleNamespace(isa_features=("fma", "i16_dot")), SimpleNamespace(isa_features=("fma",))
# (requested decode, prefill), build, weight format, bfloat16 products -> (int16 decode rows, int16 every row)
ACTIVATIONS = [
    (("auto", "auto"), VNNI, "q4_0", False, (True, True)),
    (("auto", "auto"), VNNI, "q6_k", False, (True, True)),
    (("auto", "auto"), NO_VNNI, "q4_0", False, (False, False)),  # the avx2 build: float32 products
    (("auto", "auto"), VNNI, "q8_0", False, (True, True)),  # 8-bit blocks too
    (("auto", "auto"), VNNI, "f32", False, (False, False)),
    (("auto", "auto"), VNNI, "q4_k", True, (False, False)),  # dtype bfloat16: its bfloat16 products as asked
    (("auto", "float32"), VNNI, "q4_0", False, (True, False)),
    (("float32", "auto"), VNNI, "q4_0", False, (False, False)),
    (("int16", "auto"), NO_VNNI, "q4_0", False, (True, False)),
    (("auto", "int16"), VNNI, "bf16", False, (True, True)),  # asked for: the load refuses a model without blocks
    (("int16", "float32"), VNNI, "f32", False, (True, False)),
]


@pytest.mark.parametrize(("asked", "kernels", "fmt", "bf16", "want"), ACTIVATIONS)
def test_auto_activations_are_int16_where_it_pays(asked: tuple[str, str], kernels: Any, fmt: str, bf16: bool,
                                                   want: tuple[bool, bool]) -> None:
    assert cpu_ops.int16_activations(asked, kernels, fmt, bf16) == want


def test_auto_activations_fall_back_where_the_probe_moves_a_regime_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" rounds rows to int16 only on the C kernels: a regime the probe gives to torch keeps float32 (where
    "int16", asked for, is refused: the test above)."""
    monkeypatch.setattr(cpu_ops, "int16_activations", lambda asked, kernels, fmt, bf16: (True, True))
    for figures, want in ((((1.0, 2.0), (2.0, 1.0)), (True, False)), (((2.0, 1.0), (1.0, 2.0)), (False, False))):
        monkeypatch.setattr(cpu_ops, "probe_cached", lambda *args, f=figures, **kwargs: _result(*f))
        ops = cpu_ops.resolve_cpu_ops("auto", CPU, torch.float32, "scalar", (64, 96), "q4_0", activations=("auto",) * 2)
        assert (ops.int16_rows, ops.int16_prefill) == want, figures


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
