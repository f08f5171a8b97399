"""The record of ``gpu_check.py``: ``check.json`` merged part by part (its summary keys and goals recomputed from
the parts' own keys at every save: ``gpu_check_goals.derived``), the part's log, guarded timed sub-steps and a
watchdog that saves what was measured before a part overruns its time. Text that reaches the record or a log
names the repository ``<repo>``, a virtual environment ``<venv>``, the temp folder ``<tmp>`` and the home folder
``~`` (``scrub``), as it is written."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from gpu_check_goals import derived

# The keys each part owns in check.json: a rerun of a part replaces them and keeps the other part's.
PART_KEYS: dict[int, tuple[str, ...]] = {
    1: ("kernel_tests", "greedy_equal", "greedy", "greedy_equal_piecewise", "tensor_parallel", "hf"),
    2: (
        "e2e",
        "decode_roofline_fraction",
        "graphs_speedup",
        "decode",
        "prefill",
        "hardware",
        "model",
        "mixed",
        "piecewise",
        "piecewise_speedup",
        "burst_schedule",
        "peers",
        "fp8",
    ),
}
SCHEMA_DEFAULTS: dict[str, Any] = {
    "kernel_tests": {"passed": 0, "failed": 0, "note": "not run"},
    "greedy_equal": {},
    "decode_roofline_fraction": {},
    "graphs_speedup": {},
    "peers": {},
}


def scrub(text: str, root: Path) -> str:
    """``text`` with the repository's path as ``<repo>``, a virtual environment's as ``<venv>``, the temp folder's
    as ``<tmp>`` and the home folder's as ``~`` (the longest first: one may lie in another)."""
    places = {str(root.resolve()): "<repo>", str(root): "<repo>", tempfile.gettempdir(): "<tmp>", str(Path.home()): "~"}
    if sys.prefix != sys.base_prefix:
        places[sys.prefix] = "<venv>"
    for path in sorted((p for p in places if len(p) > 1), key=len, reverse=True):
        text = text.replace(path, places[path])
    return text


def git_commit(root: Path) -> str:
    """CBSERVE_COMMIT if set (a copied tree has no .git), else ``git rev-parse HEAD``, else "unknown"."""
    env = os.environ.get("CBSERVE_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


class Log:
    """Progress lines with the seconds since the part started, to stdout and to the part's log file."""

    def __init__(self, path: Path, root: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.root = path, root
        self._file: TextIO = path.open("w", encoding="utf-8")
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def __call__(self, msg: str) -> None:
        line = scrub(f"[{self.elapsed():7.1f}s] {msg}", self.root)
        with self._lock:
            print(line, flush=True)
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._file.close()


class Check:
    """One part's results, merged into ``out/check.json`` after every sub-step (a part cut short still leaves
    what it measured), with its own budget of seconds."""

    def __init__(self, out: Path, part: int, base: dict[str, Any], budget_s: float, root: Path) -> None:
        self.out, self.part, self.budget_s, self.root = out, part, budget_s, root
        self.path = out / "check.json"
        self.log = Log(out / f"check_part{part}.log", root)
        self.results: dict[str, Any] = dict(base)
        self.info: dict[str, Any] = {"steps": {}, "errors": {}, "budget_s": budget_s}
        self.children: list[subprocess.Popen[Any]] = []  # killed with the part when the watchdog fires
        self._running: list[str] = []
        self._lock = threading.Lock()

    def remaining(self) -> float:
        return self.budget_s - self.log.elapsed()

    def set(self, key: str, value: Any) -> None:
        self.results[key] = value
        self.save()

    def error(self, name: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else "".join(traceback.format_exception(exc)).strip()
        text = scrub(text, self.root)
        self.info["errors"][name] = text[-4000:]
        self.log(f"ERROR in {name}: {text.splitlines()[-1] if text else ''}")

    def step(self, name: str, fn: Callable[..., Any], *args: Any, min_s: float = 0.0, **kwargs: Any) -> Any:
        """Run one guarded sub-step: its time and error go to the record, None comes back when it failed or
        fewer than ``min_s`` seconds of the part's budget were left."""
        if self.remaining() < min_s:
            self.info["steps"][name] = {"ok": False, "skipped": f"{self.remaining():.0f} s of budget left"}
            self.log(f"skip {name}: {self.remaining():.0f} s of the part's budget left, it needs ~{min_s:.0f} s")
            self.save()
            return None
        self.log(f"start {name}")
        self._running.append(name)
        self.info["running"] = " > ".join(self._running)  # what a watchdog stop interrupted
        t0 = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
            ok = True
        except Exception as e:  # one failing sub-step must not cost the rest of the GPU run
            self.error(name, e)
            value, ok = None, False
        dt = time.perf_counter() - t0
        self.info["steps"][name] = {"ok": ok, "seconds": round(dt, 2)}
        self._running.pop()
        self.info["running"] = " > ".join(self._running)
        self.log(f"{'done' if ok else 'FAILED'} {name} in {dt:.1f} s")
        self.save()
        return value

    def save(self) -> None:
        """Merge this part into the file on disk (the other part's keys stay as they are)."""
        with self._lock:
            merged = load_json(self.path)
            for key in PART_KEYS[self.part]:
                merged.pop(key, None)
            merged.update(self.results)
            for key, default in SCHEMA_DEFAULTS.items():
                merged.setdefault(key, default)
            self.info["wall_s"] = round(self.log.elapsed(), 1)
            merged.setdefault("parts", {})[str(self.part)] = self.info
            merged.update(derived(merged))
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(merged, indent=2, default=str) + "\n")
            tmp.replace(self.path)

    @contextlib.contextmanager
    def watchdog(self, hard_s: float) -> Iterator[None]:
        """Past ``hard_s`` seconds the part is stopped where it stands: the record is saved first (a stuck
        kernel or a hung thread cannot be interrupted from Python)."""

        def fire() -> None:
            for child in self.children:
                with contextlib.suppress(Exception):
                    child.kill()
            self.error("watchdog", f"part {self.part} stopped after {hard_s:.0f} s")
            self.info["timed_out"] = True
            self.save()
            self.log.close()
            sys.stdout.flush()
            os._exit(124)

        timer = threading.Timer(hard_s, fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def load_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
