"""Run a throw-away cbserve deployment for benchmarks and tests: a child process that starts its own local
Ray instance (never joins another), serves ``build_app(args)`` on a free port of 127.0.0.1, prints
``READY <base_url>`` and tears everything down (Serve, then Ray) when its stdin closes.

    with local_deployment({"policy": "static", "max_num_seqs": 8}) as base_url:
        ...  # send requests to base_url
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

READY = "READY "


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``GET /health`` until it answers 200 (or raise TimeoutError / RuntimeError if the child died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the deployment process exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s:.0f}s")


@contextlib.contextmanager
def local_deployment(app_args: dict[str, Any], timeout_s: float = 600.0,
                     log_path: str | os.PathLike[str] | None = None) -> Iterator[str]:
    """Deploy cbserve with ``app_args`` (CBServeConfig fields) in a child process; yield its base URL."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "cbserve.cluster.bench_deploy", json.dumps(app_args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
    )
    try:
        base_url = _read_ready(proc, timeout_s)
        wait_healthy(base_url, timeout_s, proc)
        yield base_url
    finally:
        _stop(proc)
        if log_path:
            log.close()


def _read_ready(proc: subprocess.Popen, timeout_s: float) -> str:
    box: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(READY):
                box.append(line[len(READY):].strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    deadline = time.monotonic() + timeout_s
    # Ray's daemons inherit the child's stdout, so EOF never comes when the child dies: poll it instead.
    while t.is_alive() and proc.poll() is None and time.monotonic() < deadline:
        t.join(0.5)
    t.join(1.0)
    if not box:
        raise RuntimeError(f"deployment did not start within {timeout_s:.0f}s (exit code {proc.poll()})")
    return box[0]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None and proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the child shuts Serve and Ray down and exits
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _child(app_args: dict[str, Any]) -> int:
    import ray
    from cbserve.cluster.app import build_app
    from ray import serve

    port = int(app_args.pop("port", 0) or 0)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = port or free_port()  # picked after Ray's daemons took their ports, so they cannot collide
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({**app_args, "port": port, "host": "127.0.0.1"}), name="cbserve",
                  route_prefix="/", blocking=False)
        print(f"{READY}http://127.0.0.1:{port}", flush=True)
        sys.stdin.read()  # block until the parent closes our stdin
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="internal: a throw-away cbserve deployment")
    parser.add_argument("app_args", help="JSON object of CBServeConfig fields")
    sys.exit(_child(json.loads(parser.parse_args().app_args)))
