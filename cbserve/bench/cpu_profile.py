"""Where the cores go during a benchmark run: CPU seconds (user + system) per process of a server's process
tree and of the client, sampled from psutil (``/proc``) while the load runs, with optional py-spy profiles.

Ray sets each worker process's title to ``ray::<ActorClass>`` (``ray::SchedulerActor``, ``ray::WorkerActor``,
``ray::ServeReplica:<app>:<deployment>``, ``ray::ProxyActor``, ``ray::ServeController``; ``.method()`` is
appended while one runs), so processes are named by that title; the GCS, raylet and other helpers by their
executable. Only the tree below one root process (the server child) is looked at, never other users' Ray.

    with CpuSampler(server_pid, client_pid=os.getpid()) as sampler:
        ...  # run the load
    print(format_cpu_table(sampler.report()))
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_RAY_TITLE = re.compile(r"^ray::([^ .(]+)")


def process_label(cmdline: list[str], name: str) -> str:
    """A stable, readable name for a process: its Ray title (method suffix dropped), else the executable
    or Python module it runs."""
    first = cmdline[0] if cmdline else name
    m = _RAY_TITLE.match(first)
    if m:
        return "ray::" + m.group(1)
    joined = " ".join(cmdline)
    for key in ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env",
                "cbserve.cluster.cli.main", "vllm", "llama-server", "EngineCore"):
        if key in joined:
            return key
    return Path(first).name or name


@dataclass
class ProcStat:
    pid: int
    label: str
    first_cpu_s: float  # CPU time when first seen (0 for processes born during the run)
    last_cpu_s: float

    @property
    def used_s(self) -> float:
        return max(0.0, self.last_cpu_s - self.first_cpu_s)


@dataclass
class CpuSampler:
    """Samples every ``interval_s`` the CPU time of ``root_pid``'s process tree (and ``client_pid``) from
    ``start()`` to ``stop()``. A process already alive at ``start()`` counts from its CPU time then."""

    root_pid: int
    client_pid: int | None = None
    interval_s: float = 0.25
    procs: dict[int, ProcStat] = field(default_factory=dict)
    wall_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def start(self) -> CpuSampler:
        self._t0 = time.perf_counter()
        self._sample(initial=True)
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample(initial=False)
        self.wall_s = time.perf_counter() - self._t0

    def __enter__(self) -> CpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(initial=False)

    def _tree(self) -> list[Any]:
        import psutil

        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        if self.client_pid is not None:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(self.client_pid))
        return procs

    def _sample(self, initial: bool) -> None:
        import psutil

        for p in self._tree():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    label = "client (benchmark)" if p.pid == self.client_pid else process_label(
                        p.cmdline(), p.name())
            except psutil.Error:
                continue
            st = self.procs.get(p.pid)
            if st is None:
                self.procs[p.pid] = ProcStat(p.pid, label, cpu if initial else 0.0, cpu)
            else:
                st.last_cpu_s = max(st.last_cpu_s, cpu)
                if not label.startswith("ray::IDLE"):
                    st.label = label

    def report(self) -> dict[str, Any]:
        """CPU seconds per label (processes with the same label summed) and per process, over the run."""
        by_label: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for st in self.procs.values():
            by_label[st.label] += st.used_s
            counts[st.label] += 1
        rows = [{"process": k, "count": counts[k], "cpu_s": v, "cores": v / max(self.wall_s, 1e-9)}
                for k, v in by_label.most_common()]
        per_pid = sorted(({"pid": s.pid, "process": s.label, "cpu_s": s.used_s} for s in self.procs.values()),
                         key=lambda d: -d["cpu_s"])
        return {"wall_s": self.wall_s, "total_cpu_s": sum(by_label.values()), "by_process": rows,
                "per_pid": per_pid}

    def pids(self, label_prefix: str) -> list[int]:
        return [s.pid for s in self.procs.values() if s.label.startswith(label_prefix)]


def format_cpu_table(report: dict[str, Any], min_cpu_s: float = 0.05) -> str:
    wall = report["wall_s"]
    lines = [f"CPU time per process over {wall:.1f} s of wall time "
             f"(total {report['total_cpu_s']:.1f} CPU s = {report['total_cpu_s'] / max(wall, 1e-9):.2f} cores)",
             f"{'process':<44}{'n':>4}{'CPU s':>10}{'cores':>8}"]
    for row in report["by_process"]:
        if row["cpu_s"] >= min_cpu_s:
            lines.append(f"{row['process'][:43]:<44}{row['count']:>4}{row['cpu_s']:>10.1f}{row['cores']:>8.2f}")
    return "\n".join(lines)


def py_spy_binary() -> str | None:
    """py-spy next to this interpreter (the venv's), else on PATH."""
    import sys

    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def start_py_spy_record(pid: int, duration_s: float, out_path: str | os.PathLike[str],
                        rate: int = 50) -> subprocess.Popen | None:
    """Start ``py-spy record`` (raw collapsed stacks, non-blocking) of ``pid`` for ``duration_s``."""
    exe = py_spy_binary()
    if exe is None:
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(duration_s))), "--rate", str(rate),
           "--format", "raw", "--nonblocking", "--output", str(out_path)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def py_spy_dump(pid: int, timeout_s: float = 30.0) -> str:
    """One ``py-spy dump`` of ``pid`` (every thread's Python stack), or the reason there is none."""
    exe = py_spy_binary()
    if exe is None:
        return "py-spy not found"
    try:
        r = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                           timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"py-spy dump failed: {e}"
    return r.stdout if r.returncode == 0 else f"py-spy dump failed ({r.returncode}): {r.stderr[-500:]}"


def _stacks(collapsed: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output as (frames outermost first, samples) per line."""
    out = []
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append(([f.strip() for f in stack.split(";")], int(count)))
    return out


def _shares(counts: Counter[str], total: int, n: int) -> list[tuple[str, float]]:
    return [(frame, c / total) for frame, c in counts.most_common(n)] if total else []


def top_frames(collapsed: str, n: int = 15) -> list[tuple[str, float]]:
    """The ``n`` innermost frames holding most samples in py-spy's raw (collapsed) output, with their share."""
    stacks = _stacks(collapsed)
    leaf: Counter[str] = Counter()
    for frames, count in stacks:
        leaf[frames[-1]] += count
    return _shares(leaf, sum(c for _, c in stacks), n)


def inclusive_frames(collapsed: str, n: int = 20) -> list[tuple[str, float]]:
    """Frames by the share of samples whose stack holds them (each frame counted once per stack)."""
    stacks = _stacks(collapsed)
    seen: Counter[str] = Counter()
    for frames, count in stacks:
        for frame in set(frames):
            seen[frame] += count
    return _shares(seen, sum(c for _, c in stacks), n)
