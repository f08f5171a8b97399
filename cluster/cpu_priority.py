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

The same Ray instance is also told to idle quietly (``LOCAL_RAY_ENV``): Serve's controller runs its control loop
every 0.5 s instead of every 0.1 s (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``). At 10 Hz that loop, and the GCS
work it causes, was the largest CPU user of an idle server: 3.5% + 1.9% of a core, out of 0.19 cores for all
of Ray and cbserve; at 0.5 s 1.3% + 0.7%, and 0.12 cores in all. Every core-second the neighbours take is
one the model's OpenMP team loses during a burst. The cost: Serve notices a replica change up to 0.4 s later
(its health checks run every 10 s anyway).

Measured on 2 cores (BENCHMARKS.md, "CPU priority"). Linux only (niceness per thread); elsewhere these do
nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import psutil

BACKGROUND_NICENESS = 19
EDGE_NICENESS = 10
# What a Ray instance `cbserve serve` starts inherits (a value already in the environment wins): the actors'
# niceness, which the raylet gives them (Ray's default 15), and the Serve controller's loop period (Ray's 0.1 s).
LOCAL_RAY_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
_LINUX = sys.platform.startswith("linux")


def set_niceness(pid: int, niceness: int) -> bool:
    """Every thread of ``pid`` at ``niceness`` (Linux niceness is per thread; threads started later inherit
    it from the thread that starts them). False when the process is gone or not ours."""
    try:
        tids = [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return False
    done = False
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
            done = True
        except OSError:  # the thread ended meanwhile, or lowering niceness without the privilege
            continue
    return done


def run_at_edge_niceness() -> None:
    """This process (an ingress replica) at the HTTP edge's niceness, unless it already runs behind that."""
    if _LINUX and os.getpriority(os.PRIO_PROCESS, 0) < EDGE_NICENESS:
        set_niceness(os.getpid(), EDGE_NICENESS)


def _target(process: psutil.Process, start: int) -> int | None:
    """The niceness ``process`` gets from the sweep (None: left as it is). ``start``: what the sweep found the
    local instance's processes at (the root's niceness)."""
    try:
        argv0 = (process.cmdline() or [""])[0]
        chose = process.nice() > start  # the ingress replicas set their own
    except psutil.Error:
        return None
    if not argv0 or os.path.basename(argv0) == "raylet" or argv0.startswith("ray::IDLE"):
        return None
    if argv0.startswith("ray::ProxyActor"):  # Serve's HTTP proxy: the edge, when direct ingress is off
        return EDGE_NICENESS
    return None if chose else BACKGROUND_NICENESS


def background_ray_processes(root: int, engines: Iterable[int]) -> list[int]:
    """``root`` (``cbserve serve``) and every process below it (the local Ray instance and what runs on it),
    except the engines' processes ``engines``, to the niceness ``_target`` says; returns the pids changed."""
    if not _LINUX:
        return []
    keep = set(engines)
    try:
        tree = psutil.Process(root)
        processes = [*tree.children(recursive=True), tree]
        start = tree.nice()
    except psutil.Error:
        return []
    changed = []
    for process in processes:
        target = None if process.pid in keep else _target(process, start)
        if target is not None and set_niceness(process.pid, target):
            changed.append(process.pid)
    return changed
