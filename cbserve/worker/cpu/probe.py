"""``cpu_ops="auto"``'s start-up probe: are the C kernels' linear products at least as fast as torch's on
this CPU, at the model's own shapes?

The C kernels are the default because on the CPUs they were tuned on they are faster than torch's (oneDNN / MKL)
products. A CPU they were not tuned for must not get a default slower than the fallback it would otherwise run,
so before the model is built the probe times one decode-shaped product (one row) and one prefill-shaped product
(``PREFILL_ROWS`` rows) of a weight of the model's MLP shape (its hidden size in, up to ``MAX_COLUMNS`` of its
gate/up columns out), each on the C kernels and on the torch path ``auto`` would fall back to (oneDNN's packed
weight where torch has oneDNN, else ``F.linear``), in the products' dtype. Each figure is the best of a few runs
after a warm-up, the two paths timed alternately on one thread (tens of milliseconds in all: one thread, because
both scale alike over threads, while a thread team timed beside a busy neighbour measures the neighbour: on a
loaded 2-core machine the C kernels' team took 1.8x oneDNN's time, alone on one thread they were faster, and such
a verdict is kept). The C kernels are kept when the
geometric mean of their time over torch's, across the two shapes, is at most ``NATIVE_MARGIN`` (1.2: no slower
beyond timing noise). The figures and the choice are logged and reported in ``/stats``.

A verdict is kept beside the kernel library it was taken with (``probe_cached``): every engine replica and
every restart on one machine runs the same path, so replicas answer one request with the same numbers, and
replicas that start together take turns (a file lock) instead of timing each other's contention.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cbserve.worker.cpu.kernels import CpuKernels
from cbserve.worker.cpu.linear import pack_weight, packed_linear, packing_supported

DECODE_ROWS = 1
PREFILL_ROWS = 128
MAX_COLUMNS = 2048  # columns of the probe's weight at most (a large model's MLP would take seconds to pack)
_MAX_SECONDS = 0.1  # per row count: stop repeating once this much time is spent
_REPEATS = 7
# The C kernels are kept unless they take this much longer than torch's path: a margin over timing noise on a
# busy machine (the probe is there for CPUs where they are several times slower, as on AVX2 before the
# kernels were written for its register width), not for a few percent either way.
NATIVE_MARGIN = 1.2
PROBE_VERSION = 3  # in the kept verdicts' key: a changed way of probing probes again


@dataclass(frozen=True)
class ProbeResult:
    """Milliseconds per product at each row count, C kernels and torch, and what they decide."""

    shape: tuple[int, int]  # the probe weight's [n, k]
    rows: tuple[int, ...]
    native_ms: tuple[float, ...]
    torch_ms: tuple[float, ...]
    torch_path: str  # "onednn" | "torch"

    @property
    def ratio(self) -> float:
        """Geometric mean over the row counts of the C kernels' time over torch's (< 1: the C kernels win)."""
        logs = [math.log(max(a, 1e-9) / max(b, 1e-9)) for a, b in zip(self.native_ms, self.torch_ms, strict=True)]
        return math.exp(sum(logs) / len(logs))

    @property
    def native_wins(self) -> bool:
        return self.ratio <= NATIVE_MARGIN

    def summary(self) -> str:
        n, k = self.shape
        parts = [f"{r} row{'s' if r > 1 else ''}: {a:.3f} vs {b:.3f} ms"
                 for r, a, b in zip(self.rows, self.native_ms, self.torch_ms, strict=True)]
        return (f"[{n}, {k}] products, C kernels vs {self.torch_path}: " + ", ".join(parts)
                + f" (ratio {self.ratio:.2f})")

    def as_dict(self) -> dict[str, object]:
        return {"shape": list(self.shape), "rows": list(self.rows), "native_ms": list(self.native_ms),
                "torch_ms": list(self.torch_ms), "torch_path": self.torch_path, "ratio": self.ratio,
                "native_wins": self.native_wins}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ProbeResult:
        def floats(key: str) -> tuple[float, ...]:
            return tuple(float(v) for v in d[key])  # type: ignore[attr-defined]

        shape = tuple(int(v) for v in d["shape"])  # type: ignore[attr-defined]
        rows = tuple(int(v) for v in d["rows"])  # type: ignore[attr-defined]
        return cls((shape[0], shape[1]), rows, floats("native_ms"), floats("torch_ms"), str(d["torch_path"]))


def best_ms_pair(a: Callable[[], object], b: Callable[[], object], repeats: int = _REPEATS,
                 budget_s: float = _MAX_SECONDS) -> tuple[float, float]:
    """The fastest of up to ``repeats`` timed calls of ``a`` and of ``b``, in milliseconds, after one warm-up
    call of each. The calls alternate, so a neighbour taking the cores for a while slows both alike instead
    of only the one timed then; fewer repeats once ``budget_s`` is spent."""
    a()
    b()
    best, spent = [math.inf, math.inf], 0.0
    for _ in range(repeats):
        for i, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best[i], spent = min(best[i], dt), spent + dt
        if spent > budget_s:
            break
    return 1000 * best[0], 1000 * best[1]


def _torch_product(weight: torch.Tensor, dtype: torch.dtype) -> tuple[str, Callable[[torch.Tensor], object]]:
    """The product the torch fallback would run for this weight: oneDNN's packed weight where it applies."""
    w = weight.to(dtype)
    if packing_supported(w):
        packed = pack_weight(w)
        return "onednn", lambda x: packed_linear(x.to(dtype), packed, None)
    return "torch", lambda x: F.linear(x.to(dtype), w)


def probe_linear(kernels: CpuKernels, hidden: int, inter: int, bf16_products: bool = False,
                 rows: tuple[int, ...] = (DECODE_ROWS, PREFILL_ROWS)) -> ProbeResult:
    """Time a [min(2 * inter, MAX_COLUMNS), hidden] weight's products on the C kernels and on torch."""
    n, k = min(2 * inter, MAX_COLUMNS), hidden
    gen = torch.Generator().manual_seed(0)  # the global generator (request sampling) stays untouched
    weight = torch.randn(n, k, generator=gen) * 0.02
    panels = kernels.pack_weight(weight, "bf16_dot" if bf16_products else "f32")
    path, torch_fn = _torch_product(weight, torch.bfloat16 if bf16_products else torch.float32)
    native_ms, torch_ms = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the C kernels run on torch's OpenMP threads too (native.py)
    try:
        with torch.inference_mode():
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                native, other = best_ms_pair(lambda x=x: kernels.linear(x, panels, None), lambda x=x: torch_fn(x))
                native_ms.append(native)
                torch_ms.append(other)
    finally:
        torch.set_num_threads(threads)
    return ProbeResult((n, k), tuple(rows), tuple(native_ms), tuple(torch_ms), path)


def verdict_path(kernels: CpuKernels, hidden: int, inter: int, bf16_products: bool,
                 rows: tuple[int, ...] = (DECODE_ROWS, PREFILL_ROWS)) -> Path:
    """Where the probe's verdict for this library, shape, dtype and torch build is kept: beside the library,
    whose name already hashes its sources, compiler flags and CPU."""
    key = json.dumps([PROBE_VERSION, kernels.path.name, hidden, inter, bf16_products, list(rows), torch.__version__])
    return kernels.path.with_name(f"probe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def probe_cached(kernels: CpuKernels, hidden: int, inter: int, bf16_products: bool = False) -> ProbeResult:
    """``probe_linear``'s verdict, taken once per library, shape and torch build on this machine: read back
    when it is kept, else probed under an exclusive lock (so concurrent starters wait for the first one's
    verdict) and kept. A folder that cannot be written only costs the sharing: the probe runs each time."""
    path = verdict_path(kernels, hidden, inter, bf16_products)
    try:
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held across the probe below
    except OSError:
        return probe_linear(kernels, hidden, inter, bf16_products)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = _read_verdict(path)
        if kept is not None:
            return kept
        result = probe_linear(kernels, hidden, inter, bf16_products)
        _keep_verdict(path, result)
        return result


def _keep_verdict(path: Path, result: ProbeResult) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(result.as_dict()))
        tmp.replace(path)
    except OSError:  # an unwritable folder only costs the sharing: the next start probes again
        pass


def _read_verdict(path: Path) -> ProbeResult | None:
    try:
        return ProbeResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):  # none kept yet, or a damaged file: probe
        return None
