"""Run a throw-away cbserve deployment for benchmarks and tests: ``cbserve serve`` in a child process that
starts its own local Ray instance (``--ray-address local``, never joins another) and serves the config
``app_args`` on a free port of 127.0.0.1; it is stopped (Ctrl-C: Serve, then Ray, shut down) on leaving.
This module never imports Ray: the child does.

    with local_deployment({"policy": "static", "max_num_seqs": 8}) as base_url:
        ...  # send requests to base_url
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"


# Ports handed out for a server to bind later come from below Linux's default ephemeral range (32768-60999):
# the kernel gives every bind(0) and outgoing connection a port from that range (Ray starts dozens while the
# server comes up), so a port picked there and released could be taken before the server binds it.
FREE_PORT_RANGE = (20000, 32000)


def free_port(rng: random.Random | None = None) -> int:
    """A port of 127.0.0.1 that nothing is bound to now, outside the ephemeral range."""
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.randrange(*FREE_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORT_RANGE}")


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 health_path: str = "/health") -> None:
    """Poll ``GET {health_path}`` until it answers 200 (or raise TimeoutError / RuntimeError if the child died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the deployment process exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(base_url + health_path, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s:.0f}s")


@contextlib.contextmanager
def local_deployment(app_args: dict[str, Any], timeout_s: float = 600.0,
                     log_path: str | os.PathLike[str] | None = None,
                     extra_args: list[str] | None = None) -> Iterator[str]:
    """Deploy cbserve with ``app_args`` (CBServeConfig fields) in a child process; yield its base URL.
    ``extra_args`` are more ``cbserve serve`` flags (e.g. ``["--use-compiled-graph", "false"]``).
    The child's output goes to ``log_path`` (appended) when given."""
    with local_deployment_process(app_args, timeout_s, log_path, extra_args) as (base_url, _):
        yield base_url


@contextlib.contextmanager
def local_deployment_process(app_args: dict[str, Any], timeout_s: float = 600.0,
                             log_path: str | os.PathLike[str] | None = None,
                             extra_args: list[str] | None = None,
                             ray_address: str = "local") -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`local_deployment` that also yields the ``cbserve serve`` child (its process tree is the
    deployment's Ray instance: GCS, raylet, actors). ``ray_address``: a running cluster's address makes the
    child join it (e.g. a ``ray.cluster_utils.Cluster`` of simulated nodes) instead of starting its own."""
    port = int(app_args.get("port") or 0) or free_port()
    config = {k: v for k, v in app_args.items() if k not in ("host", "port")}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory(prefix="cbserve-deploy-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(json.dumps(config))  # JSON is YAML
        cmd = serve_command(config_file, port, timeout_s, ray_address) + list(extra_args or [])
        base_url = f"http://{HOST}:{port}"
        with server_process(cmd, base_url, timeout_s, log_path, env) as proc:
            yield base_url, proc


@contextlib.contextmanager
def server_process(cmd: list[str], base_url: str, timeout_s: float = 600.0,
                   log_path: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None,
                   health_path: str = "/health") -> Iterator[subprocess.Popen]:
    """Start any HTTP server ``cmd`` (cbserve, vLLM, llama.cpp...) listening at ``base_url``, wait for
    ``GET {health_path}`` to answer 200, yield the process; on leaving stop it (Ctrl-C, then SIGTERM, then
    SIGKILL) and kill whatever of its process tree is left."""
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "ab")) if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=_default_sigint)
        try:
            wait_healthy(base_url, timeout_s, proc, health_path)
            yield proc
        finally:
            stop_process(proc)


def serve_command(config_file: str | os.PathLike[str], port: int, ready_timeout_s: float = 600.0,
                  ray_address: str = "local") -> list[str]:
    """The child's command line: ``cbserve serve`` on a new local Ray instance (or joining ``ray_address``)."""
    return [
        sys.executable, "-m", "cbserve.cluster.cli.main", "serve", "--ray-address", ray_address,
        "--config", str(config_file), "--host", HOST, "--port", str(port),
        "--ready-timeout", str(ready_timeout_s),
    ]  # fmt: skip


def _default_sigint() -> None:
    """In the child before it runs: Ctrl-C stops it even when this process ignores SIGINT (a shell's background job
    does: its children would inherit that, and a Python server would then wait out SIGTERM's grace)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_process(proc: subprocess.Popen) -> None:
    """Ctrl-C (a server shuts down and exits), then SIGTERM, then SIGKILL; then SIGKILL to whatever is left
    of its process group (the child is started in a session of its own, so that is its tree only)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        for grace_s, escalate in ((120, proc.terminate), (30, proc.kill)):
            try:
                proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                escalate()
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
