"""The path of a request through cbserve's code, recorded: what ``docs/design.md``'s "One request, end to end"
is checked against (tests/e2e/test_request_path.py).

``PathTrace`` records, for each thread and each asyncio task it runs on, every hop: a call into one of cbserve's files
from another file (or from outside cbserve: the event loop resuming a task, a thread starting), as the file called
(a profile hook's "call" events, paths relative to the package). A call within a file is no hop (Ray's wrapper
around an actor's methods is seen through: a method's call to another of its class stays within the file); a
return is none either, so a file that calls two others in turn shows as those two. Each actor of a replica holds
one that its ``path_trace`` method starts and stops on the thread that runs its requests: the ingress on its request
loop and the engine on its event loop at once (``command``), a worker on its model thread
at its next step (``command_later``, then ``sync`` there: that thread is busy serving the steps).
Nothing is recorded otherwise, and the hook costs nothing while off. Python 3.11 has no hook over every thread
at once (``sys.monitoring`` is 3.12's), so a trace is started from the thread it records.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

_ROOT = str(Path(__file__).resolve().parents[2]) + "/"  # the cbserve package
# Ray wraps each method of an actor class in a function of this file (``_resume_span``, a no-op without tracing): an
# actor's call to its own method passes through it, and is still a call within the actor's file.
_RAY_WRAPPER = "ray/util/tracing/tracing_helper.py"


class PathTrace:
    def __init__(self) -> None:
        self.legs: dict[str, list[str]] = {}  # "thread/task" -> the files its calls entered, in order
        self.wanted = False  # for a thread busy in a loop of its own (a worker's model thread): see ``sync``

    def command(self, command: str) -> dict[str, list[str]]:
        """What an actor's ``path_trace`` does on the thread it runs on: "start", or "stop" (the legs recorded)."""
        self.wanted = self._command(command)
        sys.setprofile(self._event if self.wanted else None)
        return {} if self.wanted else self._take()

    def command_later(self, command: str) -> dict[str, list[str]]:
        """``command`` for another thread, which applies it at its next ``sync`` (the legs so far on "stop")."""
        self.wanted = self._command(command)
        return {} if self.wanted else self._take()

    def sync(self) -> None:
        """On the recorded thread, at the top of each unit of its work: record from now on, or stop, as asked."""
        if (sys.getprofile() is not None) != self.wanted:
            sys.setprofile(self._event if self.wanted else None)

    @staticmethod
    def _command(command: str) -> bool:
        if command not in ("start", "stop"):
            raise ValueError(f"path_trace: 'start' or 'stop', got {command!r}")
        return command == "start"

    def _take(self) -> dict[str, list[str]]:
        legs, self.legs = self.legs, {}
        return legs

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        if not name.startswith(_ROOT) or name.endswith("path_trace.py"):
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename.endswith(_RAY_WRAPPER):
            caller = caller.f_back  # Ray's pass-through wrapper around every actor method: seen through
        if caller is not None and caller.f_code.co_filename == name:
            return  # a call within its own file: no hop
        task = asyncio.current_task() if asyncio._get_running_loop() is not None else None
        key = f"{threading.current_thread().name}/{0 if task is None else id(task)}"
        leg = self.legs.get(key)
        if leg is None:
            leg = self.legs[key] = []
        leg.append(name[len(_ROOT):])
