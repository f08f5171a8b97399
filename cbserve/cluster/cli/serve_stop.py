"""How ``cbserve serve`` stops (``serve_cli.py``): SIGINT and SIGTERM at any stage, the drain of the ingress replicas
once the app is ready, and the shutdown of what was started (the app, the stores it leaves, Ray).

The drain starts as the signal arrives: everything the call needs (the app's handle, Serve's router behind it, the
replicas it reaches) is resolved while the app is ready and idle (``drain_handle``), so the signal's path is one
call from this process to each ingress replica (``OpenAIIngress.drain``)."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Any

from cbserve.cluster.cli import say
from cbserve.config import CBServeConfig
from cbserve.config.autoscaling import starts_at_zero

logger = logging.getLogger(__name__)


class StopRequested(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (the signal's name is the message); what runs is interrupted."""


class StopSignals:
    """SIGINT and SIGTERM caught whatever this process inherited: a shell without job control starts its background
    commands with SIGINT ignored, and the server must still stop (Serve, then Ray, shut down) on ``kill -INT``, as on
    a service manager's SIGTERM. The first one raises ``StopRequested``; later ones are ignored, so the drain and
    the shutdown it started run to their end (a service manager sends SIGKILL after its own timeout)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] | None = None  # the handlers before install(); None: not installed

    def install(self) -> None:
        self.received = None
        previous = {sig: signal.signal(sig, self._stop) for sig in self.SIGNALS}
        if self._previous is None:
            self._previous = previous

    def reinstall(self) -> None:
        """Installed again, when installed (something else may have put its own handler in place)."""
        if self._previous is not None:
            for sig in self.SIGNALS:
                signal.signal(sig, self._stop)

    @property
    def installed(self) -> bool:
        return self._previous is not None

    def hold(self) -> None:
        """Signals from now on are ignored: a shutdown under way runs to its end."""
        if self.received is None:
            self.received = "(shutting down)"

    def check(self) -> None:
        """``StopRequested`` when a signal came and its interruption got lost (caught by code it interrupted)."""
        if self.received is not None:
            raise StopRequested(self.received)

    def restore(self) -> None:
        if self._previous is not None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            self._previous = None

    def _stop(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            raise StopRequested(self.received)


STOP = StopSignals()


@dataclass
class Started:
    """What ``cbserve serve`` started so far, for its shutdown: the stage it is in, Ray (its modules once imported),
    and whether the app was deployed."""

    stage: str = "while the configuration is checked"
    ray: Any = None
    serve: Any = None
    config: CBServeConfig | None = None
    deployed: bool = False
    done: bool = False

    def enter(self, stage: str) -> None:
        """The next stage, unless a stop came meanwhile."""
        STOP.check()
        self.stage = stage

    def shut_down(self) -> None:
        """The app (when deployed) and its stores, then Ray; once."""
        if self.ray is None or self.config is None or self.done:
            return
        self.done = True
        STOP.hold()
        shut_down_app(self.serve, self.ray, self.config, self.deployed)


def app_handle(serve: Any, config: CBServeConfig) -> Any:
    """The app's handle, for the drain (None: a stop shuts down without draining)."""
    try:
        return serve.get_app_handle(config.app_name)
    except Exception as e:  # serving goes on
        logger.warning("no handle on the app (%s: %s): a stop will not drain", type(e).__name__, e)
        return None


def warm(handle: Any, config: CBServeConfig) -> None:
    """Everything the drain's call needs, in place before a signal comes: Serve builds a handle's router (the
    controller's replica set, each replica's actor) on its first call, which took seconds on a busy node (this
    process and Serve's controller run behind the engine: cluster/ops/cpu_priority.py) while the streams in flight ran
    on and /health answered 200. A dry-run drain on every ingress replica (nothing changes) builds it now, while the
    app is idle. An app that starts at zero has no replica to ask: its handle learns of them as Serve starts them."""
    if starts_at_zero(config.autoscaling):
        return
    try:
        handle.broadcast("drain", dry_run=True).results(timeout_s=60.0)
    except Exception as e:  # the drain builds what it needs when it starts
        logger.warning("the app's handle was not warmed (%s: %s): a drain may start late", type(e).__name__, e)


def drain(handle: Any, config: CBServeConfig) -> None:
    """The ingress's graceful drain (``OpenAIIngress.drain``) on every ingress replica at once (autoscaling runs
    several): requests in flight finish for up to ``shutdown_timeout`` seconds, new ones are refused meanwhile,
    the rest are aborted with an error."""
    say(f"cbserve: draining (up to {config.shutdown_timeout:g}s for the requests in flight)")
    try:
        done = handle.broadcast("drain").results(timeout_s=config.shutdown_timeout + 30.0)
    except Exception as e:  # the app is going down either way: say so and shut down
        say(f"cbserve: drain failed ({type(e).__name__}: {e})")
        return
    in_flight, aborted = sum(d["in_flight"] for d in done), sum(d["aborted"] for d in done)
    say(f"cbserve: drained: {in_flight - aborted} of {in_flight} requests in flight finished, {aborted} aborted "
        f"(on {len(done)} ingress replica{'' if len(done) == 1 else 's'})")


def shut_down_app(serve: Any, ray: Any, config: CBServeConfig, deployed: bool = True) -> None:
    """The app (when ``deployed``), the stores it leaves (responses, LoRA adapters), then Ray."""
    from cbserve.cluster.stores.lora_store import remove_store  # imports Ray
    from cbserve.cluster.stores.response_store import remove_response_store

    try:
        if deployed:
            serve.delete(config.app_name)
            if ray.is_initialized():
                remove_response_store(config.app_name)  # the responses stored while serving go with the app
            if config.enable_lora:
                remove_store(config.app_name)  # the adapters loaded while serving go with the app
    finally:
        ray.shutdown()
