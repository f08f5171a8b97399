"""``cbserve serve`` stops (Serve, then Ray, shut down) on SIGINT and on SIGTERM, at any stage, even when it was
started with SIGINT ignored: a shell without job control (a script's ``cmd &``, CI, ``make`` run in the background)
starts its commands so, and Python then never raises KeyboardInterrupt. Before, such a server slept on through
``kill -INT`` until a harness killed it (tests/e2e/test_serve_cli.py hung 90 s at its Ctrl-C), and a SIGTERM while
the engines loaded ended the command with Ray's own handler (status 15, Serve not shut down). The blocking parts run
in a child process here, with Ray and Serve faked in the child; the e2e tests stop a real server."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from cbserve.cluster.cli import serve as serve_cli

CHILD = """
import signal, sys
from cbserve.cluster.cli.serve import wait_for_stop
print("ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "default", flush=True)
print("stopped by", wait_for_stop(), flush=True)
"""

# `cbserve serve` with Ray and Serve faked: each fake says what it does; `serve.run` (the engines loading the model)
# and the drain's results (the requests in flight finishing) take their time, for a signal to land there
FAKED_MAIN = """
import argparse, sys, time
import ray
from ray import serve
from cbserve.cluster.cli import serve as serve_cli

def say(*what):
    print(*what, flush=True)

class Results:
    def __init__(self, method, kw):
        self.method, self.kw = method, kw

    def results(self, timeout_s):
        if self.method == "drain" and not self.kw:
            say("drain started")
            time.sleep(float(sys.argv[2]))
        return [{"in_flight": 2, "aborted": 0}]

handle = argparse.Namespace(broadcast=lambda method, **kw: say("broadcast", method, kw) or Results(method, kw))
serve_cli.start_ray = lambda *a: say("ray started") or (True, False)
serve_cli.write_for_local_ray = lambda: "sd.json"
serve_cli.wait_ready = lambda *a: (True, None)
serve_cli.await_ready = lambda *a: say("ready") or (True, None)
serve.start = lambda http_options: say("serve started")
serve.run = lambda app, **kw: say("engines loading") or time.sleep(float(sys.argv[1]))
serve.delete = lambda name: say("app deleted")
serve.get_app_handle = lambda name: handle
ray.is_initialized = lambda: False
ray.shutdown = lambda: say("ray shut down")
parser = argparse.ArgumentParser()
serve_cli.add_arguments(parser)
rc = serve_cli.main(parser.parse_args(["--device", "cpu", "--max-model-len", "256"]))
say("exit", rc)
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_server_started_with_sigint_ignored_still_stops_on_the_signal(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ignored"  # started as a background job would be
        time.sleep(1.0)  # into wait_for_stop (its handlers are set before it sleeps)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert out.strip() == f"stopped by {sig.name}"


def _faked_main(load_s: float, drain_s: float, *signal_after: str) -> list[str]:
    """The faked ``cbserve serve``'s output lines; a SIGTERM goes to it once it printed ``signal_after[0]``, another
    once it printed ``signal_after[1]`` after that, and so on."""
    proc = subprocess.Popen([sys.executable, "-c", FAKED_MAIN, str(load_s), str(drain_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=_ignore_sigint)  # fmt: skip
    lines: list[str] = []
    triggers = list(signal_after)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if triggers and line.startswith(triggers[0]):
                triggers.pop(0)
                proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return [line for line in lines if not line.startswith(("INFO", "WARNING", "20"))]  # not the log lines


def test_sigterm_while_the_engines_load_shuts_serve_and_ray_down_and_exits_0() -> None:
    lines = _faked_main(60, 0, "engines loading")
    assert lines == ["ray started", "serve started", "cbserve: deploying the app; its engine replicas load the model",
                     "engines loading",
                     "cbserve: shutting down (SIGTERM during start-up, while the engine replicas load the model)",
                     "app deleted", "ray shut down", "cbserve: stopped", "exit 0"]  # fmt: skip


def test_the_drain_is_warmed_at_ready_and_a_second_signal_does_not_cut_it_short() -> None:
    """Once ready, a dry-run drain reaches every replica (Serve builds the handle's router then, not on the signal's
    path); on SIGTERM the drain runs; a second SIGTERM meanwhile changes nothing: the drain and the shutdown end."""
    lines = _faked_main(0, 2.0, "broadcast drain {'dry_run': True}", "drain started")
    start = lines.index("ready")
    assert lines[start:] == ["ready", "broadcast drain {'dry_run': True}", "cbserve: shutting down (SIGTERM)",
                             "cbserve: draining (up to 20s for the requests in flight)", "broadcast drain {}",
                             "drain started",
                             "cbserve: drained: 2 of 2 requests in flight finished, 0 aborted (on 1 ingress replica)",
                             "app deleted", "ray shut down", "exit 0"]  # fmt: skip


def test_the_warm_up_precedes_the_signal_and_the_drain_follows(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import ray
    from ray import serve

    calls: list[tuple[str, dict[str, Any]]] = []
    done = argparse.Namespace(results=lambda timeout_s: [{"in_flight": 3, "aborted": 1}])
    handle = argparse.Namespace(broadcast=lambda method, **kw: calls.append((method, kw)) or done)
    monkeypatch.setattr(serve_cli, "start_ray", lambda *a: (True, False))
    monkeypatch.setattr(serve_cli, "write_for_local_ray", lambda: "sd.json")
    monkeypatch.setattr(serve_cli, "await_ready", lambda *a: (True, None))
    monkeypatch.setattr(serve, "start", lambda http_options: None)
    monkeypatch.setattr(serve, "run", lambda app, **kw: None)
    monkeypatch.setattr(serve, "delete", lambda name: calls.append(("deleted", {})))
    monkeypatch.setattr(serve, "get_app_handle", lambda name: handle)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("ray shut down", {})))
    monkeypatch.setattr(serve_cli, "wait_for_stop", lambda: calls.append(("signal", {})) or "SIGTERM")
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.main(parser.parse_args(["--device", "cpu", "--max-model-len", "256"])) == 0
    assert calls == [("drain", {"dry_run": True}), ("signal", {}), ("drain", {}), ("deleted", {}),
                     ("ray shut down", {})]  # fmt: skip
    out = capsys.readouterr().out
    assert "shutting down (SIGTERM)" in out and "drained: 2 of 3 requests in flight finished, 1 aborted" in out
