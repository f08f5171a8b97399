"""`cbserve serve` as a user runs it (the README's serving command): a subprocess that starts its own local
Ray cluster, serves the bundled model (here without the compiled graph), says where it listens, answers the
official OpenAI client, ends a request that outlives ``request_timeout_s`` with HTTP 504 (freeing its KV
blocks), drains as SIGTERM arrives and shuts down cleanly, as it does on Ctrl-C; a SIGTERM while the engine loads
the model shuts down what was started. A model its engine cannot load ends the command with that error instead of a
restart loop. The simulated engine (``--model sim``) serves through Serve's proxy."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import free_port, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("cbserve")
MODEL = "SmolLM2-135M-Instruct"
# request_timeout_s: far above an 8-token answer (< 1 s), far below 8000 tokens on a CPU (198 s on the 2-core EPYC),
# and room for the drain check's streams on a busy machine
TIMEOUT_S = 12
# how long the drain check's streams last: seconds in flight after the signal (the drain starts within a fraction of
# one: 0.59 s on a 2-core EPYC running the suite, when 1.5 s streams had only 0.57 s left), and a sixth of TIMEOUT_S
# at most, so a busy machine slowing them down 6x still finishes them (on a shared 2-core machine they took 2.4x and
# over 5x their calibrated time)
DRAIN_STREAM_S = 2.0


class Serve:
    """One ``cbserve serve`` subprocess and its output lines."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        cmd = [str(CLI), "serve", "--ray-address", "local", "--port", str(self.port), *flags]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)  # fmt: skip
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "engine replicas ready" in line:
                self.ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _engine_idle(srv: Serve) -> dict[str, Any] | None:
    (stats,) = srv.get("/stats")["replicas"]
    free = stats["num_in_flight"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    return stats if free else None


def test_cbserve_serve_with_config_file_serves_times_out_and_stops_on_ctrl_c() -> None:
    srv = Serve("--config", str(ROOT / "deploy" / "serve-local.yaml"), "--max-model-len", "8192",
                "--kv-cache-memory-bytes", str(384 * 1024**2),
                "--request-timeout-s", str(TIMEOUT_S))  # fmt: skip
    try:
        assert srv.ready.wait(300), "cbserve serve did not get ready:\n" + "".join(srv.lines[-40:])
        assert f"http://127.0.0.1:{srv.port}/v1" in srv.output  # it says where it listens
        owner = _listener(srv.port)  # it started Ray: the ingress replica serves HTTP itself (direct ingress)
        assert "ServeReplica" in owner and "OpenAIIngress" in owner, owner
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0,
                               timeout=120)  # fmt: skip
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}])  # fmt: skip
        assert r.choices[0].message.content and r.usage.completion_tokens > 0
        (stats,) = srv.get("/stats")["replicas"]  # on CPU by default: plain actor calls (the compiled graph:
        assert stats["compiled_graph"] is False and stats["dispatch_calls"] > 0  # openai_server/test_tp2)
        assert stats["worker_torch_threads"] == [len(os.sched_getaffinity(0))]  # every core, not Ray's one
        _check_priority(srv, stats["engine_pids"], _listener_pid(srv.port))  # by pid: Ray retitles it as it works
        _check_no_ray_dashboard_but_metrics_discovery(srv)
        _check_request_timeout(srv, client)
        _check_drain_on_sigterm(srv, client)
    finally:
        srv.kill()


def _check_drain_on_sigterm(srv: Serve, client: Any) -> None:
    """SIGTERM with 4 streams in flight (each streamed its first token before the signal goes): the drain starts as
    the signal arrives: /health turns 503 before any stream ended, a new request gets 503 with Retry-After, the
    streams run to their end; then the command exits 0. Nothing here assumes a speed: the streams are sized on this
    machine now, and every step waits for its condition. (The ingress is behind the engine on the CPU: a /stats poll
    to see the streams in the engine took long enough under load that the streams were nearly done by the signal.)"""
    from concurrent.futures import ThreadPoolExecutor

    tokens = _tokens_lasting(client, DRAIN_STREAM_S)
    started = threading.Semaphore(0)
    ended: list[float] = []

    def stream(i: int) -> int:
        """Streams ``tokens`` tokens (seconds: still running when the drain starts); the final usage count."""
        chunks = client.completions.create(model=MODEL, prompt=f"Count to ten, take {i}:", max_tokens=tokens,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})  # fmt: skip
        count = 0
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text and count == 0:
                count = -1
                started.release()
            if chunk.usage is not None:
                count = chunk.usage.completion_tokens
        ended.append(time.monotonic())
        return count

    def refused() -> bool:
        try:
            srv.get("/health")
            return False
        except urllib.error.HTTPError as e:
            return e.code == 503

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        for _ in futures:
            assert started.acquire(timeout=120), "a stream did not start"
        assert not ended
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        wait_for("/health 503 while draining", refused, 30, 0.02)
        refused_at = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"]
        assert [f.result(timeout=120) for f in futures] == [tokens] * 4  # every stream ran to its end
    print(f"SIGTERM to the first 503: {1000 * (refused_at - signalled):.0f} ms; the first stream ended "
          f"{min(ended) - signalled:.1f} s after the signal")
    assert refused_at < min(ended), "the drain started only after a stream ended"
    assert srv.proc.wait(timeout=90) == 0
    srv.reader.join(timeout=10)
    assert "shutting down (SIGTERM)" in srv.output, srv.output[-3000:]
    draining = re.search(r"draining: (\d+) requests in flight", srv.output)  # the ingress's line, as it starts
    assert draining and int(draining[1]) >= 4, srv.output[-3000:]
    drained = re.search(r"drained: (\d+) of (\d+) requests in flight finished, 0 aborted", srv.output)
    assert drained and drained[1] == drained[2] and int(drained[1]) >= 4, srv.output[-3000:]  # + any /health poll


def _tokens_lasting(client: Any, seconds: float) -> int:
    """How many tokens 4 streams decode side by side in about ``seconds`` on this machine now (timed on 4 such
    32-token answers at once), kept within a sixth of TIMEOUT_S: a fixed count either outlives the request timeout
    on a busy machine or ends before the drain starts on a quiet one; timing one answer alone underrated a busy
    2-core machine's batch of 4 (the streams ran past TIMEOUT_S)."""
    from concurrent.futures import ThreadPoolExecutor

    def answer(i: int) -> None:
        client.completions.create(model=MODEL, prompt=f"Count, take {i}:", max_tokens=32, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip

    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(answer, range(4)))
    per_token = (time.monotonic() - t0) / 32
    return max(32, min(int(seconds / per_token), int(TIMEOUT_S / 6 / per_token)))


def _check_no_ray_dashboard_but_metrics_discovery(srv: Serve) -> None:
    """Its Ray instance runs without Ray's dashboard (no ``--ray-dashboard``): none of the dashboard's module
    processes; Prometheus's service-discovery file is in the session dir all the same, and its target is
    the node's metrics export port, where cbserve's series are."""
    import psutil

    cmdlines = [" ".join(p.cmdline()) for p in psutil.Process(srv.proc.pid).children(recursive=True)]
    assert not [c for c in cmdlines if "ray-dashboard-" in c], cmdlines
    (session,) = {m for c in cmdlines for m in re.findall(r"--session[-_]dir=(\S+)", c)}
    (group,) = json.loads((Path(session) / "prom_metrics_service_discovery.json").read_text())
    assert group["labels"] == {"job": "ray"}
    (target,) = group["targets"]

    def cbserve_series() -> bool:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
            return b"ray_cbserve_" in r.read()

    wait_for("cbserve's series on the discovered metrics port", cbserve_series, 60)


def _check_request_timeout(srv: Serve, client: Any) -> None:
    """Requests still running after request_timeout_s, one whole and one streamed, side by side: both aborted in
    the engine (their blocks freed); the whole one answered 504 with OpenAI's error body, the streamed one with an
    error event, then [DONE]."""
    from concurrent.futures import ThreadPoolExecutor

    long = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 8000,
            "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        t0 = time.monotonic()
        whole = pool.submit(client.completions.create, **long)
        events = _timed_out_stream(srv, {k: v for k, v in long.items() if k != "extra_body"} | {"ignore_eos": True})
        with pytest.raises(openai.InternalServerError) as info:
            whole.result(timeout=TIMEOUT_S + 60)
        assert TIMEOUT_S <= time.monotonic() - t0 < TIMEOUT_S + 30
    assert info.value.status_code == 504
    error = info.value.response.json()["error"]
    assert error["type"] == "timeout" and "request_timeout_s" in error["message"], error
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == 504 and last["error"]["type"] == "timeout", last
    assert len(events) > 3  # tokens were streamed before the deadline
    stats = wait_for("the timed-out requests' blocks freed", lambda: _engine_idle(srv), 20, 0.2)
    assert stats["num_aborted"] == 2


def _timed_out_stream(srv: Serve, body: dict[str, Any]) -> list[str]:
    """The SSE events of ``body`` streamed until the server ends it."""
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/v1/completions",
                                 data=json.dumps(body | {"stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200  # committed to a stream before the deadline
        return [line.removeprefix("data: ") for line in r.read().decode().splitlines() if line.startswith("data: ")]


def test_cbserve_serve_exits_with_the_engines_error_when_the_model_cannot_load(tmp_path: Path) -> None:
    """config.json and tokenizer, no weights: the start-up checks pass, the workers fail to load. The
    replica is not rebuilt in a loop: `cbserve serve` prints its error and exits non-zero."""
    from cbserve.worker.loading.model_loader import resolve_model

    src, folder = resolve_model(None).folder, tmp_path / "no-weights"
    folder.mkdir()
    for f in src.iterdir():
        if f.name == "config.json" or f.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(f, folder / f.name)
    srv = Serve("--model", str(folder), "--device", "cpu", "--max-model-len", "256", "--kv-cache-memory-bytes",
                str(16 * 1024**2), "--worker-torch-threads", "1")  # fmt: skip
    try:
        rc = srv.proc.wait(timeout=300)
        srv.reader.join(timeout=10)
        assert rc == 1, srv.output
        # (the command writes its line whole; Ray's thread printing the actors' logs may begin a line before it)
        errors = re.findall(r"cbserve: error: [^\n]*\n", srv.output)
        assert errors == [f"cbserve: error: engine replica 0: no safetensors weights in {folder}\n"], srv.output
        assert "engine replicas ready" not in srv.output
    finally:
        srv.kill()


def test_cbserve_serve_stops_cleanly_on_sigterm_while_the_engine_loads() -> None:
    """SIGTERM while the engine replica is being built and loads the model (its scheduler actor's process is up,
    the app not ready): the command says so, shuts Serve and Ray down (no process of its Ray instance is left) and
    exits 0, as a service manager expects of a stop it asked for. Before, Ray's own handler ended it with status 15."""
    import psutil

    srv = Serve("--device", "cpu", "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 * 1024**2),
                "--worker-torch-threads", "1")  # fmt: skip
    try:

        def building() -> list[psutil.Process] | None:
            below = psutil.Process(srv.proc.pid).children(recursive=True)
            return below if any("ray::SchedulerActor" in " ".join(p.cmdline()) for p in below) else None

        below = wait_for("the engine replica being built", building, 300, 0.1)
        assert "engine replicas ready" not in srv.output
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=120) == 0, srv.output[-3000:]
        srv.reader.join(timeout=10)
        stage = "cbserve: shutting down (SIGTERM during start-up, while the engine replicas load the model)"
        assert stage in srv.output and "cbserve: stopped" in srv.output, srv.output[-3000:]
        assert "engine replicas ready" not in srv.output

        def left() -> list[int]:
            return [p.pid for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

        wait_for("no process of its Ray instance left", lambda: not left(), 30)
    finally:
        srv.kill()


def _check_priority(srv: Serve, engine_pids: list[int], ingress_pid: int | None) -> None:
    """The engine (its actor, which runs the model's one rank) first on the CPU, the HTTP edge (the ingress
    replica, Serve's proxy) at niceness 10 under SCHED_BATCH, the rest of the Ray instance cbserve started (its
    GCS...) at 19 under SCHED_BATCH, the raylet left as it was; Serve's controller started with the 0.5 s control
    loop and the ingress replica with its code on its own event loop (cluster/ops/cpu_priority.py)."""
    import psutil

    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert "first on the CPU" in srv.output
    below = psutil.Process(srv.proc.pid).children(recursive=True)
    titles = {p.pid: " ".join(p.cmdline()) for p in below}
    (engine,) = engine_pids  # tensor-parallel size 1: no worker actor
    assert "ray::SchedulerActor" in titles[engine]
    assert not [title for title in titles.values() if "ray::WorkerActor" in title]

    def priority(pid: int) -> tuple[int, int]:
        return psutil.Process(pid).nice(), os.sched_getscheduler(pid)

    def priority_of(part: str) -> tuple[int, int]:
        (pid,) = [pid for pid, title in titles.items() if part in title]
        return priority(pid)

    assert priority(engine) == (base, os.SCHED_OTHER)
    edge, rest = (10, os.SCHED_BATCH), (19, os.SCHED_BATCH)
    assert ingress_pid is not None
    assert [priority(ingress_pid), priority_of("ray::ProxyActor"), priority_of("gcs_server")] == [edge, edge, rest]
    (raylet,) = [p for p in below if os.path.basename(p.cmdline()[0]) == "raylet"]
    assert priority(raylet.pid) == (base, os.SCHED_OTHER) and priority(srv.proc.pid) == rest
    (controller,) = [pid for pid, title in titles.items() if "ray::ServeController" in title]
    assert psutil.Process(controller).environ().get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == "0.5"
    assert psutil.Process(ingress_pid).environ().get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == "0"


def _check_untuned(srv: Serve) -> None:
    """``--node-tuning off``: no process reniced or moved to SCHED_BATCH, Ray's own actor niceness (15) and
    Serve's own control loop period."""
    import psutil

    assert "first on the CPU" not in srv.output and "node tuning: off" in srv.output
    below = psutil.Process(srv.proc.pid).children(recursive=True)
    assert all(os.sched_getscheduler(p.pid) == os.SCHED_OTHER for p in below if p.is_running())
    (controller,) = [p for p in below if "ray::ServeController" in " ".join(p.cmdline())]
    assert controller.nice() == min(psutil.Process(srv.proc.pid).nice() + 15, 19)  # Ray's own actor niceness
    assert "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in controller.environ()


def _listener(port: int) -> str:
    """The command line of the process listening on ``port`` of this machine ("" when none)."""
    pid = _listener_pid(port)
    return "" if pid is None else " ".join(__import__("psutil").Process(pid).cmdline())


def _listener_pid(port: int) -> int | None:
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    return None


def test_cbserve_serve_model_sim_without_direct_ingress_serves_through_the_proxy() -> None:
    """``--direct-ingress false``: Serve's proxy listens on --port and streams the ingress's answers. With
    ``--node-tuning off`` every process of the Ray instance keeps the OS's and Ray's defaults. The model is
    ``sim`` (the simulated engine: an H100 serving Llama-3-8B, no weights) on 2 engine replicas: the whole stack
    above it answers the official client, streamed and not, with text the bundled tokenizer decodes."""
    srv = Serve("--model", "sim", "--num-replicas", "2", "--max-model-len", "4096", "--direct-ingress", "false",
                "--node-tuning", "off")  # fmt: skip
    try:
        assert srv.ready.wait(300), "cbserve serve did not get ready:\n" + "".join(srv.lines[-40:])
        owner = _listener(srv.port)
        assert "ProxyActor" in owner, owner
        _check_untuned(srv)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0,
                               timeout=120)  # fmt: skip
        assert [m.id for m in client.models.list().data] == ["sim"]
        messages = [{"role": "user", "content": "Hello!"}]
        reply = client.chat.completions.create(model="sim", messages=messages, max_tokens=12)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
        assert reply.choices[0].message.content
        stream = client.chat.completions.create(model="sim", messages=messages, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=90) == 0
    finally:
        srv.kill()


def test_cbserve_serve_refuses_direct_ingress_on_a_cluster_it_does_not_start() -> None:
    proc = subprocess.run([str(CLI), "serve", "--direct-ingress", "true", "--ray-address", "auto"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "--direct-ingress true needs the Ray instance" in proc.stderr, proc.stderr
