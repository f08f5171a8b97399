"""CPU priority on a serving node: the engine (model workers and scheduler) first, the HTTP edge next, the
rest of Ray behind both.

On a small CPU node the model worker's OpenMP team needs every core, and every other process of the
deployment (the ingress replicas, Serve's controller and proxy, Ray's GCS, dashboard, agents and log
monitor) takes its CPU out of that team about one for one: a preempted OpenMP thread stalls its partner at
the next barrier. Ray starts actor processes at niceness 15 (``RAY_worker_niceness``) and its own daemons at
0, so by default the model ran *behind* Ray's daemons. Three levels instead:
- 0, the engine: the model workers, and the scheduler actor, which is on every step's path (behind the
  workers its replies wait for a core while the worker waits for its next step: 13-16 ms a step);
- 10, the HTTP edge (``EDGE_NICENESS``: the ingress replicas set it themselves, and Serve's proxy): behind
  the engine but with enough of the CPU to take requests in during a burst (at 19 a 64-request burst
  trickled into the engine: median TTFT 16-20 s instead of 3.5-4 s);
- 19, everything else (``BACKGROUND_NICENESS``).

Raising one's own niceness needs no privilege, lowering it does; so ``cbserve serve``, when it starts the Ray
instance, starts it with ``RAY_worker_niceness=0`` (actors start at 0) and, once the engine replicas are
ready, raises every other process it started (``background_ray_processes``), leaving alone the engines'
(their pids from ``/stats``), those that chose their own niceness, the raylet (the actors it starts later
inherit its niceness) and Ray's idle pooled workers. On a cluster it joins, only the ingress replicas move,
and only where the cluster starts actors ahead of 10 (``RAY_worker_niceness`` below 10 on ``ray start``).

Measured on 2 cores (BENCHMARKS.md, "CPU priority"). Linux only (``/proc``); elsewhere these do nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

BACKGROUND_NICENESS = 19
EDGE_NICENESS = 10
WORKER_NICENESS_ENV = {"RAY_worker_niceness": "0"}  # what the raylet gives the actors it starts
_PROC = Path("/proc")


def set_niceness(pid: int, niceness: int, proc: Path = _PROC) -> bool:
    """Every thread of ``pid`` at ``niceness`` (Linux niceness is per thread; threads started later inherit
    it from the thread that starts them). False when the process is gone or not ours."""
    try:
        tids = [int(t) for t in os.listdir(proc / str(pid) / "task")]
    except OSError:
        return False
    done = False
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            done = True
        except OSError:  # the thread ended meanwhile, or lowering niceness without the privilege
            continue
    return done


def niceness(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid)


def run_at_edge_niceness() -> None:
    """This process (an ingress replica) at the HTTP edge's niceness, unless it already runs behind that."""
    if _PROC.is_dir() and niceness(0) < EDGE_NICENESS:
        set_niceness(os.getpid(), EDGE_NICENESS)


def _parents(proc: Path) -> dict[int, int]:
    """pid -> parent pid of every process readable in ``proc``."""
    out: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int, proc: Path = _PROC) -> list[int]:
    """Every process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents(proc).items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _argv0(pid: int, proc: Path) -> bytes:
    try:
        return (proc / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return b""


def _target(pid: int, start: int, proc: Path) -> int | None:
    """The niceness ``pid`` gets from the sweep (None: left as it is). ``start``: what the sweep found the
    local instance's processes at (the root's niceness)."""
    argv0 = _argv0(pid, proc)
    if not argv0 or os.path.basename(argv0) == b"raylet" or argv0.startswith(b"ray::IDLE"):
        return None
    if argv0.startswith(b"ray::ProxyActor"):  # Serve's HTTP proxy: the edge, when direct ingress is off
        return EDGE_NICENESS
    try:
        chose = niceness(pid) > start  # the ingress replicas set their own
    except OSError:
        return None
    return None if chose else BACKGROUND_NICENESS


def background_ray_processes(root: int, engines: Iterable[int], proc: Path = _PROC) -> list[int]:
    """``root`` (``cbserve serve``) and every process below it (the local Ray instance and what runs on it),
    except the engines' processes ``engines``, to the niceness ``_target`` says; returns the pids changed."""
    if not proc.is_dir():
        return []
    keep = set(engines)
    start = niceness(root)
    changed = []
    for pid in [*descendants(root, proc), root]:
        target = None if pid in keep else _target(pid, start, proc)
        if target is not None and set_niceness(pid, target, proc):
            changed.append(pid)
    return changed
