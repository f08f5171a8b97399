"""CPU priority on a serving node: the engine (model workers and scheduler) first, the HTTP edge next, the
rest of Ray behind both.

On a small CPU node the model worker's OpenMP team needs every core, and every other process of the
deployment (the ingress replicas, Serve's controller and proxy, Ray's GCS, dashboard, agents and log
monitor) takes its CPU out of that team about one for one: a preempted OpenMP thread stalls its partner at
the next barrier. Ray starts actor processes at niceness 15 (``RAY_worker_niceness``) and its own daemons at
0, so by default the model ran *behind* Ray's daemons. Three levels instead:
- 0, the engine: the model workers, and the scheduler actor, which is on every step's path (behind the
  workers its replies wait for a core while the worker waits for its next step: 13-16 ms a step);
- 10, the HTTP edge (``EDGE``: the ingress replicas set it themselves, and Serve's proxy): behind
  the engine but with enough of the CPU to take requests in during a burst (at 19 a 64-request burst
  trickled into the engine: median TTFT 16-20 s instead of 3.5-4 s);
- 19, everything else (``BACKGROUND``).
Niceness sets a thread's share when the cores are contended, but under SCHED_OTHER a neighbour that wakes (a
token to stream, a timer) still preempts a running OpenMP thread at once. So both levels behind the engine
also run under SCHED_BATCH: a waking thread waits for a core to idle (the worker's between steps, a serial
stretch) or for the next scheduler tick. The neighbours get the same CPU, in the engine's gaps. SCHED_IDLE for
the rest gave the worker a little more (1.76 cores of a burst against 1.74, 1.73 before), but Serve's
controller and the CLI then starve while the engine is busy: a Ctrl-C during a burst took 32 s to exit
instead of 25-26 s. Unlike SCHED_IDLE, SCHED_BATCH can be left again without a privilege
(BENCHMARKS.md, "CPU policy").

Raising one's own niceness needs no privilege, lowering it does; so ``cbserve serve``, when it starts the Ray
instance, starts it with ``RAY_worker_niceness=0`` (actors start at 0) and, once the engine replicas are
ready, raises every other process it started (``background_ray_processes``), leaving alone the engines'
(their pids from ``/stats``), those that chose their own priority, the raylet (the actors it starts later
inherit its niceness) and Ray's idle pooled workers. On a cluster it joins, only the ingress replicas move,
and only where the cluster starts actors ahead of 10 (``RAY_worker_niceness`` below 10 on ``ray start``).

The same Ray instance is also told to idle quietly (the ``engine-first`` profile of ``node_tuning.py``): Serve's
controller runs its control loop every 0.5 s instead of every 0.1 s (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``). At 10
Hz that loop, and the GCS work it causes, was the largest CPU user of an idle server: 3.5% + 1.9% of a core, out of
0.19 cores for all of Ray and cbserve; at 0.5 s 1.3% + 0.7%, and 0.12 cores in all. Every core-second the
neighbours take is one the model's OpenMP team loses during a burst. The cost: Serve notices a replica change up to
0.4 s later (its health checks run every 10 s anyway). And the ingress replicas run their code on the replica's own
event loop (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``, part of Serve's throughput-optimized mode) instead of
a second loop in a thread of its own: every streamed chunk then goes to the HTTP connection without a hand-off
between the two loops' threads (0.144 ms of the ingress's CPU per streamed token against 0.171, mean of 6 bursts
each, alternated).

Measured on 2 cores. Linux only (niceness and policy per thread); elsewhere these do nothing. All of it is the
``engine-first`` node-tuning profile (``node_tuning.py``); ``node_tuning: off`` turns it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

# Linux scheduling policies (os.SCHED_* exist on Linux only; the values are the kernel's).
SCHED_OTHER = getattr(os, "SCHED_OTHER", 0)
SCHED_BATCH = getattr(os, "SCHED_BATCH", 3)


@dataclass(frozen=True)
class Priority:
    """Where a process's threads run on a node's CPU: ``niceness``, their share when the cores are contended,
    and ``policy``: whether a thread that wakes may preempt a running one (SCHED_OTHER) or waits for an idle
    core or the scheduler's tick (SCHED_BATCH)."""

    niceness: int
    policy: int = SCHED_OTHER


ENGINE = Priority(0)
EDGE = Priority(10, SCHED_BATCH)
BACKGROUND = Priority(19, SCHED_BATCH)
_LINUX = sys.platform.startswith("linux")


def set_priority(pid: int, priority: Priority) -> bool:
    """Every thread of ``pid`` at ``priority`` (Linux niceness and policy are per thread; threads started later
    inherit them from the thread that starts them). False when the process is gone or not ours."""
    try:
        tids = [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return False
    done = False
    for tid in tids:
        try:
            os.sched_setscheduler(tid, priority.policy, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, priority.niceness)
            done = True
        except OSError:  # the thread ended meanwhile, or lowering niceness without the privilege
            continue
    return done


def run_at_edge_priority() -> None:
    """This process (an ingress replica) at the HTTP edge's priority; a niceness already behind the edge's
    (a joined cluster's actors may start at Ray's 15) is kept."""
    if _LINUX:
        niceness = max(os.getpriority(os.PRIO_PROCESS, 0), EDGE.niceness)
        set_priority(os.getpid(), Priority(niceness, EDGE.policy))


def _target(process: psutil.Process, start: int) -> Priority | None:
    """The priority ``process`` gets from the sweep (None: left as it is). ``start``: what the sweep found the
    local instance's processes at (the root's niceness)."""
    try:
        argv0 = (process.cmdline() or [""])[0]
        chose = process.nice() > start  # the ingress replicas set their own
    except psutil.Error:
        return None
    if not argv0 or os.path.basename(argv0) == "raylet" or argv0.startswith("ray::IDLE"):
        return None
    if argv0.startswith("ray::ProxyActor"):  # Serve's HTTP proxy: the edge, when direct ingress is off
        return EDGE
    return None if chose else BACKGROUND


def background_ray_processes(root: int, engines: Iterable[int]) -> list[int]:
    """``root`` (``cbserve serve``) and every process below it (the local Ray instance and what runs on it),
    except the engines' processes ``engines``, to the priority ``_target`` says; returns the pids changed."""
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
        if target is not None and set_priority(process.pid, target):
            changed.append(process.pid)
    return changed
