"""cpu_ops="auto"'s start-up probe (cbserve/worker/cpu/probe.py): each regime of the linear products is decided on
its own measured figures with no margin, on the model's own weight format; the verdict is kept per library, CPU,
torch version, format and shape, and taken again when it is old; a weight on mixed paths dispatches by row count
(linear.RegimeWeight). Stand-ins replace the timings where a decision is tested; the real probe runs on tiny
shapes."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cbserve.worker.cpu import native as cpu_native
from cbserve.worker.cpu import probe as cpu_probe
from cbserve.worker.cpu.gguf_blocks import BLOCKS_FILE
from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.linear import MANY_ROWS, NativeWeight, RegimeWeight, make_packed_weight, native_weight
from cbserve.worker.cpu.probe import (
    MAX_AGE_S,
    ProbeResult,
    RegimeTiming,
    model_weights,
    probe_cached,
    probe_linear,
    regime_timing,
    verdict_path,
)

pytestmark = pytest.mark.skipif(cpu_native._compiler() is None, reason="no C compiler on this machine")


def test_a_regime_keeps_the_c_kernels_only_when_they_were_no_slower() -> None:
    assert RegimeTiming(1, 1.0, 1.0).path == "native"  # a tie keeps them
    assert RegimeTiming(1, 1.01, 1.0).path == "torch"  # 1% slower with runs that never scattered: no margin
    assert RegimeTiming(1, 1.01, 1.0, scatter=0.02).path == "native"  # within the runs' own scatter: a tie
    assert RegimeTiming(128, 6.33, 4.62, scatter=0.05).path == "torch"
    r = ProbeResult((192, 64), "q4_1", "onednn", RegimeTiming(1, 0.200, 0.218), RegimeTiming(128, 6.33, 4.62), 5.0)
    assert r.paths == ("native", "torch")  # the figures of one verdict that once covered both regimes
    assert ProbeResult.from_dict(json.loads(json.dumps(r.as_dict()))) == r
    assert "few rows (1 row): 0.200 vs 0.218 ms, scatter 0.0% -> native" in r.summary()
    assert "many rows (128 rows): 6.330 vs 4.620 ms" in r.summary() and "q4_1" in r.summary()


def test_the_scatter_is_measured_from_the_runs() -> None:
    tie = regime_timing(1, [1.0, 1.1, 1.2], [0.99, 1.0, 1.01])  # torch 1% faster, runs scattered by 10%
    assert (tie.native_ms, tie.torch_ms, tie.scatter, tie.path) == (1.0, 0.99, pytest.approx(0.1), "native")
    slower = regime_timing(128, [2.0, 2.02, 2.04], [1.0, 1.01, 1.02])
    assert slower.path == "torch" and slower.scatter == pytest.approx(0.01)


@dataclass
class _Recorder:
    """A stand-in packed weight that records the row counts it multiplies."""

    name: str
    dtype: torch.dtype = torch.float32
    rows: list[int] = field(default_factory=list)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return torch.zeros(x.shape[0], 3, dtype=self.dtype)


def test_a_weight_on_mixed_paths_dispatches_by_row_count() -> None:
    few, many = _Recorder("few"), _Recorder("many", torch.bfloat16)
    w = RegimeWeight(few, many)
    for m in (1, MANY_ROWS - 1, MANY_ROWS, 4 * MANY_ROWS):
        assert w.matmul(torch.ones(m, 4), torch.ones(3)).dtype == torch.float32  # the model's dtype back
    assert few.rows == [1, MANY_ROWS - 1] and many.rows == [MANY_ROWS, 4 * MANY_ROWS]


@pytest.mark.parametrize("paths", [("native", "torch"), ("torch", "native")])
def test_mixed_paths_hold_both_packings_with_the_same_products(kernels: CpuKernels, paths: tuple[str, str]) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(100, 64, generator=gen).bfloat16().float()
    packed = make_packed_weight(w, kernels, compact=True, paths=paths)
    assert isinstance(packed, RegimeWeight)
    assert (native_weight(packed) is not None) is (paths[0] == "native")  # what the C layer driver may use
    assert isinstance(packed.few if paths[0] == "native" else packed.many, NativeWeight)
    for m in (1, MANY_ROWS):
        x = torch.randn(m, 64, generator=gen)
        assert torch.allclose(packed.matmul(x, None), F.linear(x, w), atol=1e-4, rtol=1e-4)
    assert native_weight(make_packed_weight(w, kernels, compact=True)).panels.fmt == "bf16"


@pytest.mark.parametrize("fmt,bf16,panel_fmt", [("q4_0", False, "q4_0"), ("q8_0", True, "q8_0_bf16"),
                                                ("bf16", False, "bf16"), ("f32", True, "bf16_dot"),
                                                ("q6_k", False, "q6_k"), ("q4_k", True, "q4_k"),
                                                ("q5_k", False, "q5_k")])
def test_the_real_probe_times_the_models_format_in_both_regimes(kernels: CpuKernels, fmt: str, bf16: bool,
                                                                panel_fmt: str) -> None:
    r = probe_linear(kernels, 64, 96, fmt, bf16, now=123.0)
    # a K-quant's k: one whole 256-value block (the model's K-quant weights keep float32 products)
    assert r.weight_format == panel_fmt and r.shape == (192, 256 if fmt.endswith("_k") else 64) and r.taken_at == 123.0
    assert (r.few.rows, r.many.rows) == (1, MANY_ROWS)
    assert min(r.few.native_ms, r.few.torch_ms, r.many.native_ms, r.many.torch_ms) > 0
    assert r.torch_path in ("onednn", "torch")
    assert probe_linear(kernels, 80, 4096, "q4_1").shape == (2048, 64)  # whole blocks; the weight stays small
    with pytest.raises(ValueError, match="weight_format"):
        probe_linear(kernels, 64, 96, "q3_k")


def test_a_verdict_is_shared_keyed_and_taken_again_when_old(kernels: CpuKernels, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas starting together take one verdict (the first probes under the lock, the others read it); another
    format, shape or torch version is probed apart; an old, future-dated or damaged verdict is probed again."""
    lib = CpuKernels(Path(shutil.copy(kernels.path, tmp_path / kernels.path.name)), isa=kernels.isa)
    calls = []

    def stand_in(k: CpuKernels, hidden: int, inter: int, fmt: str, bf16: bool, now: float,
                 int16_rows: bool = False, int16_every_row: bool = False) -> ProbeResult:
        calls.append((hidden, fmt, int16_rows) + (("every row",) if int16_every_row else ()))
        return ProbeResult((2 * inter, hidden), fmt, "onednn", RegimeTiming(1, 1, 2), RegimeTiming(128, 2, 1), now)

    monkeypatch.setattr(cpu_probe, "probe_linear", stand_in)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: probe_cached(lib, 64, 96, "q4_0", now=1000.0), range(4)))
    assert len(calls) == 1 and all(r == results[0] for r in results)
    path = verdict_path(lib, 64, 96, "q4_0", False)
    assert path.parent == tmp_path and ProbeResult.from_dict(json.loads(path.read_text())) == results[0]
    assert probe_cached(lib, 64, 96, "q4_0", now=1000.0 + MAX_AGE_S) == results[0] and len(calls) == 1
    assert verdict_path(lib, 64, 96, "q8_0", False) != path and verdict_path(lib, 64, 96, "q4_0", True) != path
    assert verdict_path(lib, 80, 96, "q4_0", False) != path
    assert verdict_path(lib, 64, 96, "q4_0", False, int16_rows=True) != path
    assert probe_cached(lib, 64, 96, "q4_0", int16_rows=True, now=1000.0).weight_format == "q4_0"
    assert calls[-1] == (64, "q4_0", True) and len(calls) == 2  # the int16-rows products are probed apart
    assert verdict_path(lib, 64, 96, "q4_0", False, True, True) != verdict_path(lib, 64, 96, "q4_0", False, True)
    probe_cached(lib, 64, 96, "q4_0", int16_rows=True, now=1000.0, int16_every_row=True)
    assert calls[-1] == (64, "q4_0", True, "every row") and len(calls) == 3  # and every row's apart again
    calls.pop()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert verdict_path(lib, 64, 96, "q4_0", False) != path
    monkeypatch.undo()
    monkeypatch.setattr(cpu_probe, "probe_linear", stand_in)
    assert probe_cached(lib, 64, 96, "q4_0", now=1001.0 + MAX_AGE_S).taken_at == 1001.0 + MAX_AGE_S  # too old
    assert len(calls) == 3
    assert probe_cached(lib, 64, 96, "q4_0", now=2.0).taken_at == 2.0 and len(calls) == 4  # dated in the future
    path.write_text("{not json")
    assert probe_cached(lib, 64, 96, "q4_0", now=3.0).taken_at == 3.0 and len(calls) == 5


def test_the_models_weight_format_is_read_from_its_files(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {"model.layers.0.mlp.down_proj.weight": torch.ones(4, 4), "model.norm.weight": torch.ones(4)}
    save_file({k: v.bfloat16() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    assert model_weights(tmp_path) == ("bf16", 20)
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert model_weights(tmp_path) == ("f32", 20)
    (tmp_path / BLOCKS_FILE).parent.mkdir()
    raw = {f"w{i}": torch.zeros(2, 18, dtype=torch.uint8) for i in range(3)}
    save_file(raw, str(tmp_path / BLOCKS_FILE), metadata={"w0": "Q4_0", "w1": "Q4_0", "w2": "Q8_0"})
    assert model_weights(tmp_path) == ("q4_0", 20)  # the blocks most weights are kept in
    assert model_weights(tmp_path / "missing") == ("f32", 0)


def test_few_row_products_are_timed_on_weights_streamed_from_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The few-row regime's copies of the probe weight hold twice the last-level cache (64 MiB at least, 32 copies
    at most): one weight alone would stay in the cache, where a float32 copy outruns a compact format that a
    decode step, streaming every layer's weights from memory, reads several times faster."""
    caches = {"SC_LEVEL3_CACHE_SIZE": 32 << 20, "SC_LEVEL2_CACHE_SIZE": 1 << 20}
    monkeypatch.setattr(cpu_probe.os, "sysconf", lambda name: caches[name])
    assert cpu_probe.stream_copies(2048 * 896 * 4) == 10  # 7.3 MB each: 73 MB >= 64 MiB
    assert cpu_probe.stream_copies(1 << 20) == 32  # capped
    assert cpu_probe.stream_copies(1 << 30) == 1
    caches["SC_LEVEL3_CACHE_SIZE"] = 256 << 20  # a server's L3: twice it
    assert cpu_probe.stream_copies(16 << 20) == 32
    assert cpu_probe.stream_copies(64 << 20) == 8
    caches["SC_LEVEL3_CACHE_SIZE"] = 0  # not reported (some VMs): the minimum
    assert cpu_probe.stream_copies(16 << 20) == 4
