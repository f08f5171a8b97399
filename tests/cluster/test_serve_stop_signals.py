"""``cbserve serve`` stops (Serve, then Ray, shut down) on SIGINT and on SIGTERM, even when it was started with
SIGINT ignored: a shell without job control (a script's ``cmd &``, CI, ``make`` run in the background) starts
its commands so, and Python then never raises KeyboardInterrupt. Before, such a server slept on through
``kill -INT`` until a harness killed it (tests/e2e/test_serve_cli.py hung 90 s at its Ctrl-C). The blocking
part (``serve_cli.wait_for_stop``) runs in a child process here; the e2e test stops a real server."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import signal, sys
from cbserve.cluster.serve_cli import wait_for_stop
print("ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "default", flush=True)
print("stopped by", wait_for_stop(), flush=True)
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
