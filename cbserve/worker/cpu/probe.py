"""``cpu_ops="auto"``'s start-up probe: for each regime of the model's linear products, which path is faster on
this CPU, at the model's shapes and in the model's own weight format: the C kernels or torch's product of the
same weights (oneDNN's packed weight where torch has oneDNN, else ``F.linear``).

The regimes are decided apart, because one path can win one and lose the other: **few rows** (a decode step's
rows, one per running request; timed at ``FEW_ROWS``), where the cost is streaming the weights and the C kernels
read their compact formats, and **many rows** (a prefill chunk's, from ``linear.MANY_ROWS`` rows on; timed at
that count), where the cost is the multiply-adds. Each is timed on a weight of the model's MLP shape (its hidden
size in, up to ``MAX_COLUMNS`` of its gate/up columns out) stored as the model stores it (``model_weight_format``:
GGUF Q8_0 / Q4_x / Q5_0 / Q4_K / Q5_K / Q6_K blocks, bfloat16 or float32 panels, or bfloat16 pairs for bfloat16
products), against torch's product of the float32 weights the format decodes to (bfloat16 for bfloat16
products). Few-row products are timed through ``stream_copies`` copies of that weight, one after the other, whose
float32 bytes are at least twice the last-level cache: their weights stream from memory, as a decode step's
do. One weight alone would stay in the cache, where torch's float32 copy can outrun a compact format that
streamed reads several times fewer bytes (a [2048, 896] Q5_0 weight on a Zen 4 EPYC with 32 MiB of L3: 0.17 ms
on the C kernels against oneDNN's 0.12 ms in cache; its model then decoded 4.9x slower on oneDNN). The measured
figures decide, with no assumed margin: each is the best of a few runs after a warm-up (figures within
``CLOSE`` of each other are timed again, longer, and the best of all runs counts), and torch takes a regime
when its best was faster than the C kernels' by more than the runs' own scatter (for each path, its median
run's distance from its best, measured in the same probe). A smaller difference is no measured difference:
the C kernels keep that regime, since torch's path for one regime holds every weight a second time. So the
probe never keeps a path it measured slower for the regime it decides. The two paths are timed alternately
on one thread (under a second in all: one thread, because
both scale alike over threads, while a thread team timed beside a busy neighbour measures the neighbour). The
figures and the choices are logged and reported in ``/stats``; ``ops.py`` turns them into the model's paths.

A verdict is kept beside the kernel library it was taken with (``probe_cached``), keyed by the probe's version,
the library (whose name hashes its sources, compiler flags and the CPU's model and flags), the CPU model, the
torch version, the weight format and the shapes, so a change of any of them probes again; a kept verdict is
taken again after ``MAX_AGE_S``, and one dated in the future is not trusted. Every engine replica and every
restart on one machine within that time runs the same paths, and replicas that start together take turns (a
file lock) instead of timing each other's contention.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cbserve.worker.cpu.abi import INT16_ROWS_FORMATS
from cbserve.worker.cpu.kernels import CpuKernels, Panels
from cbserve.worker.cpu.linear import MANY_ROWS, OneDnnWeight, PackedWeight, torch_weight
from cbserve.worker.cpu.native import cpu_model_name

FEW_ROWS = 1
MAX_COLUMNS = 2048  # columns of the probe's weight at most (a large model's MLP would take seconds to pack)
_MAX_SECONDS = 0.15  # per regime: stop repeating once this much time is spent
_REPEATS = 7
CLOSE = 0.05  # figures this close are timed again, three times as long
PROBE_VERSION = 7  # in the kept verdicts' key: a changed way of probing probes again
STREAM_MIN_BYTES = 64 << 20  # the few-row regime's copies hold at least this many float32 bytes ...
STREAM_MAX_COPIES = 32  # ... in at most this many copies
MAX_AGE_S = 7 * 24 * 3600.0  # a kept verdict older than this is taken again
# as the model stores its weights (model_weight_format)
WEIGHT_FORMATS = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")


@dataclass(frozen=True)
class RegimeTiming:
    """Milliseconds of one product of ``rows`` rows on the C kernels and on torch, and the faster path."""

    rows: int
    native_ms: float
    torch_ms: float
    scatter: float = 0.0  # the runs' relative scatter: the larger path's (median - best) / best

    @property
    def path(self) -> str:
        """"torch" when torch's best beat the C kernels' by more than the scatter, else "native"."""
        return "torch" if self.torch_ms * (1.0 + self.scatter) < self.native_ms else "native"


@dataclass(frozen=True)
class ProbeResult:
    """The probe's figures for the few-row and many-row regimes, and what they decide."""

    shape: tuple[int, int]  # the probe weight's [n, k]
    weight_format: str  # the C kernels' panel format timed ("q4_0", "bf16_dot", ...)
    torch_path: str  # "onednn" | "torch"
    few: RegimeTiming
    many: RegimeTiming
    taken_at: float = 0.0  # time.time() when measured

    @property
    def paths(self) -> tuple[str, str]:
        """("native" | "torch") for few-row and for many-row products."""
        return self.few.path, self.many.path

    def summary(self) -> str:
        n, k = self.shape
        parts = [f"{name} ({r.rows} row{'s' if r.rows > 1 else ''}): {r.native_ms:.3f} vs {r.torch_ms:.3f} ms, "
                 f"scatter {r.scatter:.1%} -> {r.path}"
                 for name, r in (("few rows", self.few), ("many rows", self.many))]
        return f"[{n}, {k}] {self.weight_format} products, C kernels vs {self.torch_path}: " + ", ".join(parts)

    def as_dict(self) -> dict[str, object]:
        return {"shape": list(self.shape), "weight_format": self.weight_format, "torch_path": self.torch_path,
                "rows": [self.few.rows, self.many.rows], "native_ms": [self.few.native_ms, self.many.native_ms],
                "torch_ms": [self.few.torch_ms, self.many.torch_ms], "scatter": [self.few.scatter, self.many.scatter],
                "paths": {"few": self.few.path, "many": self.many.path}, "taken_at": self.taken_at}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ProbeResult:
        def values(key: str) -> list[float]:
            return [float(v) for v in d[key]]  # type: ignore[attr-defined]

        shape, rows = [int(v) for v in d["shape"]], [int(v) for v in d["rows"]]  # type: ignore[attr-defined]
        native, other, scatter = values("native_ms"), values("torch_ms"), values("scatter")
        return cls((shape[0], shape[1]), str(d["weight_format"]), str(d["torch_path"]),
                   RegimeTiming(rows[0], native[0], other[0], scatter[0]),
                   RegimeTiming(rows[1], native[1], other[1], scatter[1]), float(d["taken_at"]))  # type: ignore[arg-type]


def timed_pair(a: Callable[[], object], b: Callable[[], object], repeats: int = _REPEATS,
               budget_s: float = _MAX_SECONDS) -> tuple[list[float], list[float]]:
    """Up to ``repeats`` timed calls of ``a`` and of ``b``, in milliseconds, after one warm-up call of each. The
    calls alternate, so a neighbour taking the cores for a while slows both alike instead of only the one timed
    then; fewer repeats once ``budget_s`` is spent (two at least)."""
    a()
    b()
    runs: tuple[list[float], list[float]] = ([], [])
    spent = 0.0
    for i in range(repeats):
        for fn, out in zip((a, b), runs, strict=True):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            out.append(1000 * dt)
            spent += dt
        if spent > budget_s and i >= 1:
            break
    return runs


def probe_panels(kernels: CpuKernels, n: int, k: int, weight_format: str, bf16_products: bool,
                 gen: torch.Generator) -> Panels:
    """A random [n, k] weight packed as a model in ``weight_format`` packs its weights (blocks with float16
    scales for the GGUF formats), for bfloat16 products where asked."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format in ("f32", "bf16"):
        w = torch.randn(n, k, generator=gen) * 0.02
        if bf16_products:
            return kernels.pack_weight(w, "bf16_dot")
        return kernels.pack_weight(w.bfloat16().float(), "bf16") if weight_format == "bf16" else kernels.pack_weight(w)
    d = (torch.rand(n, k // 32, generator=gen) * 0.002).half().float()
    if weight_format in ("q4_k", "q5_k", "q6_k"):  # no bfloat16-products variant: float32 products in the model
        return _kquant_panels(kernels, d[:, : k // 256].contiguous(), weight_format, gen)
    if weight_format == "q5_0":  # float32 products in the model too
        return kernels.pack_q5_0(d, torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen))
    if weight_format == "q8_0":
        panels = kernels.pack_q8_0(d, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))
    else:
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
        panels = kernels.pack_q4_0(d, q) if weight_format == "q4_0" else kernels.pack_q4_1(d, -8 * d, q)
    return kernels.with_bf16_products(panels) if bf16_products else panels


def _kquant_panels(kernels: CpuKernels, d: torch.Tensor, weight_format: str, gen: torch.Generator) -> Panels:
    n, k = d.shape[0], d.shape[1] * 256
    if weight_format == "q6_k":
        sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
        return kernels.pack_q6_k(d, sc, torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen))
    sub = [torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen) for _ in range(2)]
    pack, top = (kernels.pack_q5_k, 32) if weight_format == "q5_k" else (kernels.pack_q4_k, 16)
    return pack(d, d, *sub, torch.randint(0, top, (n, k), dtype=torch.uint8, generator=gen))


def stream_copies(weight_bytes: int) -> int:
    """Copies of a weight of ``weight_bytes`` float32 bytes that together hold twice the last-level cache (and at
    least ``STREAM_MIN_BYTES``; at most ``STREAM_MAX_COPIES``)."""
    try:
        llc = max(os.sysconf("SC_LEVEL3_CACHE_SIZE"), os.sysconf("SC_LEVEL2_CACHE_SIZE"), 0)
    except (ValueError, OSError):  # a libc without these names
        llc = 0
    return max(1, min(STREAM_MAX_COPIES, -(-max(2 * llc, STREAM_MIN_BYTES) // weight_bytes)))


def probe_linear(kernels: CpuKernels, hidden: int, inter: int, weight_format: str = "f32",
                 bf16_products: bool = False, now: float | None = None, int16_rows: bool = False,
                 int16_every_row: bool = False) -> ProbeResult:
    """Time a [min(2 * inter, MAX_COLUMNS), hidden] weight of ``weight_format`` at FEW_ROWS and MANY_ROWS rows on
    the C kernels and on torch (k rounded down to whole GGUF blocks for the block formats: of 256 for the
    K-quants); with ``int16_rows``, a 4-8-bit block format's int16-rows variant (as the model packs it: with
    ``int16_every_row``, the one whose many-row products round the rows to int16 too)."""
    block = 256 if weight_format.endswith("_k") else 32
    k = hidden if weight_format in ("f32", "bf16") else max(block, hidden // block * block)
    n = min(2 * inter, MAX_COLUMNS)
    gen = torch.Generator().manual_seed(0)  # the global generator (request sampling) stays untouched
    panels = probe_panels(kernels, n, k, weight_format, bf16_products, gen)
    if int16_rows and panels.fmt in INT16_ROWS_FORMATS:
        panels = kernels.with_int16_rows(panels, int16_every_row)
    dense = kernels.unpack(panels)
    copies = stream_copies(dense.nbytes)
    streamed = [panels] + [Panels(panels.fmt, panels.data.clone(), n, k) for _ in range(copies - 1)]
    others: list[PackedWeight] = [torch_weight(dense.clone(), bf16_products) for _ in range(copies)]
    path = "onednn" if isinstance(others[0], OneDnnWeight) else "torch"
    timings = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the C kernels run on torch's OpenMP threads too (native.py)
    try:
        with torch.inference_mode():
            for m, count in ((FEW_ROWS, copies), (MANY_ROWS, 1)):
                x = torch.randn(m, k, generator=gen)
                xt = x.to(others[0].dtype)
                timings.append(_timed(m, lambda x=x, c=count: [kernels.linear(x, p, None) for p in streamed[:c]],
                                      lambda xt=xt, c=count: [o.matmul(xt, None) for o in others[:c]], count))
    finally:
        torch.set_num_threads(threads)
    return ProbeResult((n, k), panels.fmt, path, timings[0], timings[1], time.time() if now is None else now)


def regime_timing(rows: int, native_runs: list[float], torch_runs: list[float]) -> RegimeTiming:
    """The regime's figures from the runs of each path: the bests, and the larger relative scatter."""
    def scatter(runs: list[float]) -> float:
        return (statistics.median(runs) - min(runs)) / min(runs)

    return RegimeTiming(rows, min(native_runs), min(torch_runs), max(scatter(native_runs), scatter(torch_runs)))


def _timed(rows: int, native: Callable[[], object], other: Callable[[], object], products: int = 1) -> RegimeTiming:
    """The regime's figures per product, each call of ``native`` and ``other`` running ``products`` of them."""
    a, b = timed_pair(native, other)
    if abs(min(a) - min(b)) <= CLOSE * min(min(a), min(b)):
        a2, b2 = timed_pair(native, other, 3 * _REPEATS, 3 * _MAX_SECONDS)
        a, b = a + a2, b + b2
    return regime_timing(rows, [t / products for t in a], [t / products for t in b])


def verdict_path(kernels: CpuKernels, hidden: int, inter: int, weight_format: str, bf16_products: bool,
                 int16_rows: bool = False, int16_every_row: bool = False) -> Path:
    """Where the verdict for this library, CPU, torch build, weight format and shape is kept: beside the library."""
    int16 = (["int16_rows"] if int16_rows else []) + (["int16_every_row"] if int16_every_row else [])
    key = json.dumps([PROBE_VERSION, kernels.path.name, cpu_model_name(), torch.__version__, weight_format,
                      bf16_products, hidden, inter, FEW_ROWS, MANY_ROWS] + int16)
    return kernels.path.with_name(f"probe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def probe_cached(kernels: CpuKernels, hidden: int, inter: int, weight_format: str = "f32",
                 bf16_products: bool = False, int16_rows: bool = False, now: float | None = None,
                 int16_every_row: bool = False) -> ProbeResult:
    """``probe_linear``'s verdict, taken once per library, CPU, torch build, format and shape on this machine and
    again once it is ``MAX_AGE_S`` old: read back when a fresh one is kept, else probed under an exclusive lock
    (so concurrent starters wait for the first one's verdict) and kept. A folder that cannot be written only
    costs the sharing: the probe runs each time."""
    now = time.time() if now is None else now
    path = verdict_path(kernels, hidden, inter, weight_format, bf16_products, int16_rows, int16_every_row)
    try:
        lock = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 - held across the probe below
    except OSError:
        return probe_linear(kernels, hidden, inter, weight_format, bf16_products, now, int16_rows, int16_every_row)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = read_verdict(path, now)
        if kept is not None:
            return kept
        result = probe_linear(kernels, hidden, inter, weight_format, bf16_products, now, int16_rows, int16_every_row)
        _keep_verdict(path, result)
        return result


def _keep_verdict(path: Path, result: ProbeResult) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(result.as_dict()))
        tmp.replace(path)
    except OSError:  # an unwritable folder only costs the sharing: the next start probes again
        pass


def read_verdict(path: Path, now: float) -> ProbeResult | None:
    """The verdict kept at ``path`` when it is younger than MAX_AGE_S (and not from the future); else None."""
    try:
        result = ProbeResult.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, IndexError):  # none kept yet, or a damaged file: probe
        return None
    return result if 0.0 <= now - result.taken_at <= MAX_AGE_S else None


def model_weights(folder: Path) -> tuple[str, int]:
    """How a checkpoint folder stores most of its linear weights, as the probe times them (the GGUF block type
    kept beside a converted GGUF: "q8_0", "q4_0", "q4_1"; else "bf16" for bfloat16 safetensors, else "f32"),
    and how many values its safetensors files hold. Read from the files' headers; ("f32", 0) when they cannot
    be read."""
    from collections import Counter

    from safetensors import safe_open

    from cbserve.worker.cpu.gguf_blocks import BLOCKS_FILE

    try:
        dtypes: Counter[str] = Counter()
        values = 0
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    piece = f.get_slice(name)
                    values += math.prod(piece.get_shape())
                    if name.endswith("proj.weight"):
                        dtypes[piece.get_dtype()] += 1
        fmt = "bf16" if dtypes and dtypes.most_common(1)[0][0] == "BF16" else "f32"
        if (folder / BLOCKS_FILE).exists():
            with safe_open(str(folder / BLOCKS_FILE), framework="pt") as f:
                kinds = Counter(v.lower() for v in (f.metadata() or {}).values())
            if kinds and kinds.most_common(1)[0][0] in WEIGHT_FORMATS:
                fmt = kinds.most_common(1)[0][0]
        return fmt, values
    except Exception:  # noqa: BLE001 (safetensors raises its own error types; any means: the default)
        return "f32", 0


def proc_bytes(path: str, field: str) -> int | None:
    """A kB field of a /proc file (``MemAvailable`` of /proc/meminfo, ``VmRSS`` of /proc/self/status), in bytes;
    None where there is no such file or field."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes (None where there is no such file)."""
    return proc_bytes("/proc/meminfo", "MemAvailable")
