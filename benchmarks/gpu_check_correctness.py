"""Part 1 of ``gpu_check.py``, correctness: the ``cuda``-marked tests (compiled on a GPU, interpreted on the CPU)
counted from a pytest subprocess, then greedy tokens of a tiny random model of every family against HF
transformers on the same device, through an engine run with chunked prefill, preemption and prefix-cache hits
(the models, prompts and engine driver of tests/worker: family_testlib, moe_testlib, worker_testlib)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_check_record import scrub

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# A dry run (CPU, interpreted Triton) runs two of the cuda tests: the whole set takes minutes interpreted.
DRY_RUN_TESTS = "test_write_kv_cache_int32_slots_and_empty or test_padded_decode_rows_and_fixed_splits"
DRY_RUN_FAMILIES = ("llama", "gemma2")  # the CPU's MoE path and bf16 HF reference take many seconds
MAX_NEW = 16
# the engine of tests/worker/test_model_families.py: 36 blocks of 4 tokens force preemption
ENGINE = dict(block_size=4, num_blocks=36, max_num_batched_tokens=16, max_num_seqs=4)
JOIN_AT_STEP = {"r2": 5, "r5": 9}
_OUTCOME = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def cuda_test_files() -> list[Path]:
    """Test files that carry the ``cuda`` marker (only those are collected: the others may need Ray)."""
    return sorted(p for p in TESTS.rglob("test_*.py") if "mark.cuda" in p.read_text(encoding="utf-8"))


@dataclass
class TestRun:
    """``pytest -m cuda`` running in a subprocess beside the greedy checks."""

    proc: subprocess.Popen[str] | None
    log_path: Path
    files: list[Path]
    interpreted: bool
    selection: str
    t0: float
    pump: threading.Thread | None = None  # copies pytest's output to the log, paths scrubbed, as it comes


def _pump(proc: subprocess.Popen[str], log_path: Path) -> threading.Thread:
    """Copy ``proc``'s output line by line into ``log_path`` with paths scrubbed (``scrub``): the log is written
    once, as pytest prints it."""

    def copy() -> None:
        assert proc.stdout is not None
        with log_path.open("w", encoding="utf-8") as f:
            for line in proc.stdout:
                f.write(scrub(line, ROOT))
                f.flush()

    thread = threading.Thread(target=copy, name="kernel-tests-log", daemon=True)
    thread.start()
    return thread


def start_cuda_tests(out: Path, dry_run: bool, log: Callable[[str], None]) -> TestRun:
    """Start ``pytest -m cuda`` over the marked files (output to ``kernel_tests.log``), compiled on a GPU;
    interpreted on the CPU (a dry run: ``DRY_RUN_TESTS`` only)."""
    files = cuda_test_files()
    log_path = out / "kernel_tests.log"
    interpreted = dry_run or not torch.cuda.is_available()
    selection = DRY_RUN_TESTS if dry_run else "all"
    if not files:
        return TestRun(None, log_path, files, interpreted, selection, time.perf_counter())
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-v",
        "-p",
        "no:cacheprovider",
        "-o",
        "console_output_style=classic",
        "--continue-on-collection-errors",
        *[str(f.relative_to(ROOT)) for f in files],
    ]
    if dry_run:
        cmd += ["-k", DRY_RUN_TESTS]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if interpreted:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)  # compiled, never interpreted, on the GPU
    log(f"pytest -m cuda on {len(files)} files in the background, output in {log_path.name}")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    return TestRun(proc, log_path, files, interpreted, selection, time.perf_counter(), _pump(proc, log_path))


def finish_cuda_tests(run: TestRun, timeout_s: float) -> dict[str, Any]:
    """Wait at most ``timeout_s`` more for the tests; the counts, from pytest's summary line, or from its
    per-test lines when it had to be stopped."""
    if run.proc is None:
        return {"passed": 0, "failed": 0, "note": "no test carries the cuda marker"}
    timed_out = False
    try:
        rc: int | None = run.proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
        timed_out, rc = True, None
    if run.pump is not None:
        run.pump.join(timeout=30)  # the pipe is closed: the rest of the output is on its way to the log
    text = run.log_path.read_text(encoding="utf-8", errors="replace")
    counts = _count(text, rc, timed_out)
    if rc not in (0, 1) or not counts["passed"] + counts["failed"]:  # pytest itself failed: say why
        counts["log_tail"] = text[-3000:]
    return {
        **counts,
        "mode": "interpreted" if run.interpreted else "compiled",
        "seconds": round(time.perf_counter() - run.t0, 1),
        "files": [str(f.relative_to(ROOT)) for f in run.files],
        "selection": run.selection,
    }


def _count(text: str, rc: int | None, timed_out: bool) -> dict[str, Any]:
    lines = [m for m in (_LINE.match(x) for x in text.splitlines()) if m]
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    summary = [x for x in text.splitlines() if x.startswith("=") and ("passed" in x or "failed" in x or "error" in x)]
    if summary and not timed_out:
        for n, what in _OUTCOME.findall(summary[-1]):
            key = "errors" if what.startswith("error") else what
            if key in counts:
                counts[key] += int(n)
    else:
        for m in lines:
            key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors"}.get(m[2], "skipped")
            counts[key] += 1
    failed = sorted({m[1] for m in lines if m[2] in ("FAILED", "ERROR")})
    counts["failed"] += counts.pop("errors")
    return {**counts, "returncode": rc, "timed_out": timed_out, "failed_tests": failed[:40]}


# ------------------------------------------------------------------------------------ greedy vs HF


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[Path], Path]  # saves the tiny model into a folder
    max_model_len: int | None
    min_prompt: int


def families() -> list[Family]:
    """Every family cbserve serves (worker/models): llama, qwen2 and llama3 rope from worker_testlib, the
    others from family_testlib, the mixtures of experts from moe_testlib."""
    if str(TESTS / "worker") not in sys.path:
        sys.path.insert(0, str(TESTS / "worker"))
    from family_testlib import FAMILIES, MAX_MODEL_LEN, make_family_model
    from moe_testlib import make_tiny_moe
    from worker_testlib import make_tiny_model

    out = [
        Family(n, lambda f, v=v: make_tiny_model(f, v), None, 1)
        for n, v in (("llama", "llama_gqa"), ("qwen2", "qwen2_bias"), ("llama3_tied", "llama3_tied"))
    ]
    out += [
        Family(n, lambda f, n=n: make_family_model(f, n), MAX_MODEL_LEN.get(n), 17 if n == "phi3_long" else 1)
        for n in FAMILIES
    ]
    out += [Family(n, lambda f, n=n: make_tiny_moe(f, n), None, 1) for n in ("mixtral", "qwen3_moe")]
    return out


def hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    """HF transformers' greedy continuation of one prompt on the model's device (EOS ignored)."""
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=model.device)
    model.generation_config.eos_token_id = None
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return out[0, len(prompt) :].tolist()


def engine_tokens(
    folder: Path,
    fam: Family,
    device: str,
    dtype: str,
    eager: bool,
    prompts: list[list[int]],
    graph_mode: str = "full_decode_only",
) -> dict[str, Any]:
    """Greedy tokens of cbserve's engine (chunked prefill, preemption, prefix hits, requests joining late)."""
    from worker_testlib import run_engine

    from cbserve.scheduler.requests.sampling_params import SamplingParams
    from cbserve.worker.config import ModelConfig
    from cbserve.worker.runner.executor import LocalExecutor

    cfg = ModelConfig(
        model=str(folder),
        dtype=dtype,
        device=device,
        enforce_eager=eager,  # type: ignore[arg-type]
        max_model_len=fam.max_model_len,
        cudagraph_mode=graph_mode,  # type: ignore[arg-type]
        block_size=ENGINE["block_size"],
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        max_num_seqs=ENGINE["max_num_seqs"],
    )
    executor = LocalExecutor(cfg, num_blocks=ENGINE["num_blocks"], progress=False)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        reqs = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
        run = run_engine(executor, reqs, **ENGINE, max_model_len=fam.max_model_len or 256, join_at_step=JOIN_AT_STEP)
        return {
            "tokens": [run.tokens[r][0] for r, _, _ in reqs],
            "preemptions": run.num_preemptions,
            "prefix_hits": run.prefix_hits,
            "graphs": executor.runner.graphs is not None,
            "piecewise": executor.runner.piecewise is not None,
            "backend": executor.runner.backend_cls.name,
        }
    finally:
        executor.shutdown()


def _agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """The fraction of reference tokens before each sequence's first difference."""
    same = 0
    for g, r in zip(got, ref, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
        same += n
    return same / max(1, sum(map(len, ref)))


# (name, dtype, enforce_eager, cudagraph_mode): fp32 must equal HF exactly (the goal: eager and graphs; the
# piecewise graphs of mixed steps are reported apart); bf16 is reported as the share of tokens that agree
MODES = (
    ("fp32_eager", "float32", True, "full_decode_only"),
    ("fp32_graphs", "float32", False, "full_decode_only"),
    ("fp32_piecewise", "float32", False, "full_and_piecewise"),
    ("bf16_graphs", "bfloat16", False, "full_decode_only"),
)
GOAL_MODES = ("fp32_eager", "fp32_graphs")


def check_family(check: Any, fam: Family, device: str, folder: Path, modes: tuple = MODES) -> dict[str, Any]:
    """One family: HF's greedy tokens (fp32, and bf16 for the bf16 mode) against cbserve's in each mode, every
    mode its own guarded sub-step."""
    from family_testlib import prompts

    batch = prompts(3, min_len=fam.min_prompt)
    fam.build(folder)
    refs: dict[str, list[list[int]]] = {}
    detail: dict[str, Any] = {"prompts": len(batch), "max_new_tokens": MAX_NEW}
    for mode, dtype, eager, graph_mode in modes:
        if dtype not in refs:
            refs[dtype] = check.step(f"greedy.{fam.name}.hf_{dtype}", _hf_reference, folder, device, dtype, batch)
        ref = refs[dtype]
        if ref is None:
            detail[mode] = {"ok": False, "error": "no HF reference"}
            continue
        run = check.step(
            f"greedy.{fam.name}.{mode}", engine_tokens, folder, fam, device, dtype, eager, batch, graph_mode
        )
        if run is None:
            detail[mode] = {"ok": False, "error": "engine run failed (see parts.1.errors)"}
            continue
        tokens = run.pop("tokens")
        equal = tokens == ref
        row = {**run, "equal": equal, "agreement": round(_agreement(tokens, ref), 4)}
        if not equal:
            i = next(i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b)
            row["first_mismatch"] = {"request": f"r{i}", "cbserve": tokens[i], "hf": ref[i]}
        detail[mode] = row
        check.log(
            f"  {fam.name} {mode}: {'EQUAL' if equal else 'DIFFERENT'} (agreement {row['agreement']:.2f}, "
            f"preemptions {run['preemptions']}, prefix hits {run['prefix_hits']}, graphs {run['graphs']}, "
            f"piecewise {run['piecewise']})"
        )
    return detail


def _hf_reference(folder: Path, device: str, dtype: str, batch: list[list[int]]) -> list[list[int]]:
    from family_testlib import load_hf

    hf = load_hf(folder).to(device=device, dtype=getattr(torch, dtype))
    try:
        return [hf_greedy(hf, p, MAX_NEW) for p in batch]
    finally:
        del hf
        _free(device)


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def greedy_all(check: Any, device: str, dry_run: bool) -> None:
    """Every family (a dry run: a few), each skipped when the part's budget is nearly spent."""
    fams = [f for f in families() if not dry_run or f.name in DRY_RUN_FAMILIES]
    modes = tuple(m for m in MODES if not dry_run or m[1] == "float32")
    equal: dict[str, bool | None] = {f.name: None for f in fams}
    piecewise: dict[str, bool | None] = {f.name: None for f in fams}
    detail: dict[str, Any] = {}
    check.set("greedy_equal", equal)
    min_s = 5.0 if dry_run else 20.0
    with tempfile.TemporaryDirectory(prefix="cbserve-gpu-check-") as tmp:
        for fam in fams:
            if check.remaining() < min_s:
                detail[fam.name] = {"skipped": f"{check.remaining():.0f} s of the part's budget left"}
                check.log(f"skip family {fam.name}: budget")
                continue
            t0 = time.perf_counter()
            d = check.step(f"greedy.{fam.name}", check_family, check, fam, device, Path(tmp) / fam.name, modes)
            d = d if d is not None else {"error": "see parts.1.errors"}
            d["seconds"] = round(time.perf_counter() - t0, 1)
            detail[fam.name] = d
            equal[fam.name] = all(d.get(m, {}).get("equal") is True for m in GOAL_MODES)
            piecewise[fam.name] = d.get("fp32_piecewise", {}).get("equal")
            check.set("greedy_equal", equal)
            check.set("greedy_equal_piecewise", piecewise)
            check.set("greedy", detail)
            _free(device)
