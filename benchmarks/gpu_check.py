"""``make gpu-check``: cbserve proven on one GPU in two parts of under 6 minutes each.

Part 1, correctness (``--part 1``): the ``cuda``-marked tests, compiled, in a pytest subprocess running beside
greedy tokens of a tiny random model of every family against HF transformers on the same GPU (fp32 eager and
fp32 with CUDA graphs must be equal; bf16 is reported), through chunked prefill, preemption and prefix hits;
the RL loop's controls on the GPU (``gpu_check_rl.py``: sleep, wake, a weight update) and the KV tiers' RAM tier in
pinned memory (``gpu_check_tiers.py``); then, the GPU free, HF
transformers' baselines for part 2's burst (``gpu_check_hf.py``: its best static and continuous batching,
labelled).
Part 2, speed (``--part 2``, ``gpu_check_speed.py``): a Llama-3.1-8B-shaped model with random bf16 weights:
decode, prefill and mixed steps against their rooflines (medians of interleaved repeats), the 256-request burst
against its ideal schedule with a step timeline, the peer workloads (``gpu_check_peers.py``: published
figures of TensorRT-LLM and torchao replicated, with their equivalent on this card), piecewise graphs, then the
same model with FP8 weights and KV cache (``gpu_check_fp8.py``: decode steps, the concurrency-250 workload's first
seconds against bf16's, greedy agreement and KL with bf16; "refused" below compute capability 8.9).
``--part all`` runs both, each in its own process (a dry run: one after the other in this one).

Each part merges its results into ``<out>/check.json`` after every sub-step (the other part's keys are kept;
the summary and the goals, ``gpu_check_goals.py``, are recomputed from the merged record at every save) and
logs to ``<out>/check_part<N>.log``; a failing sub-step is recorded under ``parts.<N>.errors`` and the part
goes on; a watchdog saves and stops a part that overruns. Needs torch, transformers (and triton, pytest for
the kernel tests) only: no Ray, no network. ``--dry-run``: every sub-step on the CPU with tiny shapes (the
Triton tests interpreted) in well under a minute (tests/worker/test_gpu_check_dry_run.py runs it).

    PYTHONPATH=. python3 benchmarks/gpu_check.py --part 1        # or: make gpu-check PART=1
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry-run --out /tmp/check
"""

from __future__ import annotations

import argparse
import gc
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_goals import goals
from gpu_check_record import Check, git_commit, load_json

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu"
# soft budget (sub-steps are skipped or cut short past it) and hard stop, in seconds from the part's start
BUDGET_S = {False: 290.0, True: 90.0}
HARD_S = {False: 335.0, True: 150.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["1", "2", "all"], default="all")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreted Triton (CI)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder of check.json and the logs (default: "
        "benchmarks/results/gpu; a dry run: cbserve-gpu-check-dry-run in the temp folder)",
    )
    p.add_argument("--budget-s", type=float, default=None, help="a part's soft time budget")
    args = p.parse_args(argv)
    if args.out is None:  # a dry run never overwrites the GPU's record
        args.out = Path(tempfile.gettempdir()) / "cbserve-gpu-check-dry-run" if args.dry_run else DEFAULT_OUT
    return args


def base_record(dry_run: bool, device: torch.device) -> dict[str, Any]:
    import transformers

    rec: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "commit": git_commit(ROOT),
        "dry_run": dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu_count": torch.cuda.device_count(),
    }
    try:
        import triton

        rec["triton"] = triton.__version__
    except ImportError:
        rec["triton"] = None
    return rec


def part1(check: Check, dry_run: bool, device: torch.device) -> None:
    """The cuda tests in the background while the families' greedy tokens are checked in this process; then HF
    transformers' baselines, on a GPU no test holds any more."""
    from gpu_check_correctness import finish_cuda_tests, greedy_all, start_cuda_tests
    from gpu_check_hf import hf_baselines
    from gpu_check_rl import rl_controls
    from gpu_check_speed import workload
    from gpu_check_tiers import kv_tiers_on_device

    tests = check.step(
        "kernel_tests.start", start_cuda_tests, check.out, dry_run, check.log, min_s=20 if dry_run else 60
    )
    if tests is not None and tests.proc is not None:
        check.children.append(tests.proc)
    check.step("greedy", greedy_all, check, device.type, dry_run)
    rl = check.step("rl", rl_controls, device.type, dry_run, min_s=10 if dry_run else 30)
    check.set("rl", rl or {"error": "see parts.1.errors"})
    tiers = check.step("kv_tiers", kv_tiers_on_device, device.type, dry_run, min_s=10 if dry_run else 30)
    check.set("kv_tiers", tiers or {"error": "see parts.1.errors"})
    gc.collect()
    n = torch.cuda.device_count()
    check.set(
        "tensor_parallel",
        {
            "tp2": None,
            "note": f"{n} GPU(s)"
            + ("" if n < 2 else ": TP=2 runs through Ray's executor, which this machine does not have"),
        },
    )
    if tests is not None:
        check.log("waiting for the cuda tests")
        counts = check.step("kernel_tests", finish_cuda_tests, tests, check.remaining() + 20, min_s=-1e9)
        check.set("kernel_tests", counts or {"passed": 0, "failed": 0, "note": "see parts.1.errors"})
        if counts:
            check.log(
                f"  cuda tests ({counts['mode']}): {counts['passed']} passed, {counts['failed']} failed"
                + (" (timed out)" if counts["timed_out"] else "")
            )
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf_baselines(check, workload(dry_run), device)


def part2(check: Check, dry_run: bool, device: torch.device) -> None:
    from gpu_check_speed import run_part2

    with tempfile.TemporaryDirectory(prefix="cbserve-gpu-check-model-") as tmp:
        run_part2(check, dry_run, Path(tmp))


def run_part(part: int, args: argparse.Namespace) -> int:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device (use DRY_RUN=1 / --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    if args.dry_run:
        torch.set_num_threads(1)  # the CI machine is small and shared; the shapes are tiny
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or BUDGET_S[args.dry_run]
    check = Check(args.out, part, base_record(args.dry_run, device), budget, ROOT)
    check.info.update(
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), commit=check.results["commit"], device=check.results["device"]
    )
    check.log(
        f"gpu-check part {part} on {check.results['device']} (commit {check.results['commit']}, "
        f"budget {budget:.0f} s{', dry run' if args.dry_run else ''}); record {check.path}"
    )
    with check.watchdog(HARD_S[args.dry_run] + max(0.0, budget - BUDGET_S[args.dry_run])):
        (part1 if part == 1 else part2)(check, args.dry_run, device)
        gc.collect()
    check.info["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    check.save()
    merged_goals = goals(load_json(check.path))
    errors = check.info["errors"]
    check.log(f"part {part} done in {check.log.elapsed():.0f} s, {len(errors)} error(s); goals: {merged_goals}")
    check.log.close()
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if str(ROOT) not in sys.path:  # cbserve and tests/ from this tree, installed or not (PYTHONPATH=.)
        sys.path.insert(1, str(ROOT))
    if args.part != "all":
        return run_part(int(args.part), args)
    if args.dry_run:  # one process: the CPU has no state to lose between the parts, imports cost seconds
        return max(run_part(1, args), run_part(2, args))
    status = 0
    for part in ("1", "2"):  # one process each: part 2 starts with a clean GPU whatever part 1 left behind
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--out", str(args.out)]
        cmd += ["--budget-s", str(args.budget_s)] if args.budget_s else []
        status = max(status, subprocess.run(cmd, cwd=ROOT).returncode)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
