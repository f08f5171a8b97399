"""The dashboards are proven against a live Prometheus scraping a live cbserve deployment.

A real local Ray cluster runs the cbserve app (cluster/app.py, bundled SmolLM2 GGUF on CPU, a small KV
cache so that requests get preempted and a wide beam search is rejected by the engine, n-gram speculative
decoding) on a free HTTP port.
A real Prometheus (Debian package ``prometheus``) is started on a free port with the scrape configuration of
deploy/prometheus.yml, only the service-discovery file path (this cluster's session dir) and the intervals
rewritten. After normal traffic only (completions, concurrent requests, a streamed chat completion), every
cbserve series a dashboard selects and every panel's PromQL expression (template variables = ``.*``,
``$__rate_interval`` = 5m) must return at least one finite sample through /api/v1/query, the rejected
counter at 0: a healthy cluster shows no "No data". Then, after bad requests (one rejected by the engine,
one refused at the ingress, an unknown model), every expression again, and the marks they left.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_lib import ray_env

from cbserve.bench.deploy import free_port as deploy_free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
MODEL = "SmolLM2-135M-Instruct"
RATE_INTERVAL = "5m"  # covers the whole test, so quantiles see the load
SD_FILE = "prom_metrics_service_discovery.json"

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason="prometheus binary not installed"),
]


def free_port() -> int:
    return deploy_free_port()  # outside the ephemeral range: Ray's start-up cannot take it meanwhile


def wait_for(what: str, check: Any, timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


# ---- fixtures: Ray + the cbserve app, Prometheus ---------------------------------------------------------
@pytest.fixture(scope="module")
def ray_session_dir() -> Iterator[Path]:
    ray = pytest.importorskip("ray")
    with ray_env():  # actors at niceness 0 (e2e_lib.RAY_ENV)
        ray.init(
            address="local",  # always a new cluster of our own, even if another one runs on this machine
            num_cpus=4,
            include_dashboard=True,  # the dashboard writes Prometheus's service-discovery file
            dashboard_port=free_port(),
            _system_config={"metrics_report_interval_ms": 1000},
        )
    try:
        yield Path(ray._private.worker.global_worker.node.get_session_dir_path())
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def app_url(ray_session_dir: Path) -> Iterator[str]:
    from ray import serve

    from cbserve.cluster.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "device": "cpu",
        "worker_torch_threads": 1,
        "max_model_len": 384,
        "num_kv_blocks": 24,  # 384 tokens, one max-length request: concurrent requests preempt, wide beams
        # do not fit (the engine rejects them)
        "max_num_batched_tokens": 256,
        # n-gram speculative decoding, so its series carry data too (the engine runs without async scheduling)
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    }
    try:
        serve.run(build_app(args), name="cbserve", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for("the app's /health", lambda: http_get(url + "/health")[0] == 200, 180)
        yield url
    finally:
        serve.shutdown()


def prometheus_config(sd_file: Path) -> dict[str, Any]:
    """deploy/prometheus.yml with only the discovery file path and the intervals rewritten."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    config["global"] = {**config.get("global", {}), "scrape_interval": "1s", "evaluation_interval": "1s"}
    jobs = config["scrape_configs"]
    assert len(jobs) == 1 and jobs[0]["file_sd_configs"], "deploy/prometheus.yml: one file_sd scrape job"
    for sd in jobs[0]["file_sd_configs"]:
        assert [Path(f).name for f in sd["files"]] == [SD_FILE]
        sd["files"] = [str(sd_file)]
        sd["refresh_interval"] = "1s"
    return config


@pytest.fixture(scope="module")
def prometheus_url(ray_session_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    sd_file = ray_session_dir / SD_FILE
    wait_for(f"Ray's service-discovery file {sd_file}", sd_file.exists, 60)
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(sd_file)))
    port = free_port()
    cmd = [
        PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
    ]  # fmt: skip
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            "Prometheus /-/ready", lambda: proc.poll() is None and http_get(url + "/-/ready")[0] == 200, 60
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    status, body = http_get(f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10)
    data = json.loads(body or b"{}")
    if status != 200 or data.get("status") != "success":
        raise AssertionError(f"query failed ({status}): {expr}\n{body[:500]!r}")
    return data["data"]["result"]


def has_finite_sample(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


# ---- load ---------------------------------------------------------------------------------------------
def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def copy_request(url: str) -> int:
    """An input-grounded chat completion (n-gram drafts are proposed and accepted); its completion tokens."""
    text = "Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly."
    copy = openai_client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Repeat this text exactly: {text}"}], max_tokens=32,
        temperature=0.0,
    )
    return copy.usage.completion_tokens


def run_normal_load(url: str) -> dict[str, int]:
    """A few completions, concurrent (batches, preemptions, prefix hits), and a streamed chat completion."""
    client = openai_client(url)
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4  # prefix-cache hits

    def complete(i: int) -> int:
        out = client.completions.create(model=MODEL, prompt=f"{shared}Question {i}: name a colour.",
                                        max_tokens=64, temperature=0.0)  # fmt: skip
        return out.usage.completion_tokens

    with ThreadPoolExecutor(6) as pool:
        tokens = sum(pool.map(complete, range(6)))
    tokens += copy_request(url)
    chunks = 0
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                max_tokens=12, stream=True):  # fmt: skip
        chunks += bool(chunk.choices and chunk.choices[0].delta.content)
    return {"tokens": tokens, "chunks": chunks}


def run_bad_load(url: str) -> None:
    """A request the engine rejects, one the ingress refuses, one for an unknown model."""
    from openai import BadRequestError, NotFoundError

    client = openai_client(url)
    with pytest.raises(BadRequestError):  # fits max_model_len, not the KV cache: the engine rejects it
        client.completions.create(model=MODEL, prompt="hello", n=8, max_tokens=64, temperature=0.0,
                                  extra_body={"use_beam_search": True})  # fmt: skip
    with pytest.raises(BadRequestError):  # refused at the ingress
        client.completions.create(model=MODEL, prompt="hello", max_tokens=-1)
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="hello", max_tokens=4)


# ---- the test -----------------------------------------------------------------------------------------
def dashboard_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        panels = [q for p in dash["panels"] for q in [p, *p.get("panels", [])]]
        out += [(path.name, p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    return out


_SELECTOR = re.compile(r'\bray_[a-z0-9_]+(?:\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\})?')


def dashboard_selectors() -> list[str]:
    """Every series selector (metric name and label matchers) of every dashboard query and variable."""
    exprs = [e for _, _, e in dashboard_queries()]
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        exprs += [v["query"]["query"] for v in json.loads(path.read_text())["templating"]["list"]
                  if v["type"] == "query"]  # fmt: skip
    return sorted({m.group() for e in exprs for m in _SELECTOR.finditer(substitute(e))})


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for var in ("model", "replica", "application"):
        expr = expr.replace(f"${{{var}}}", ".*").replace(f"${var}", ".*")
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


class TrickleLoad:
    """One tiny request per second while the queries run (bounded: at most ``limit`` requests), as on a
    live deployment: Ray stops exporting a gauge or histogram that is not updated for a while."""

    def __init__(self, url: str, limit: int = 240) -> None:
        self.url, self.limit, self.stop = url, limit, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
        for _ in range(self.limit):
            if self.stop.wait(1.0):
                return
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=30).read()

    def __enter__(self) -> TrickleLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_every_dashboard_query_returns_data(app_url: str, prometheus_url: str) -> None:
    started = time.monotonic()
    load = run_normal_load(app_url)
    assert load["tokens"] > 0 and load["chunks"] > 0
    with TrickleLoad(app_url):
        # Prometheus found Ray's metrics port through the discovery file and scrapes it.
        targets = wait_for("a healthy scrape target", lambda: query(prometheus_url, 'up{job="ray"} == 1'), 60)
        assert targets
        # Drafts again once Prometheus holds the spec-decode counters: the draft-rate panels need an increase
        # that two of its samples see.
        wait_for("the spec-decode counters scraped",
                 lambda: query(prometheus_url, "sum(ray_cbserve_spec_decode_num_drafts_total) > 0"), 90)
        copy_request(app_url)
        check_healthy_cluster(prometheus_url, started)
        run_bad_load(app_url)
        check_dashboards(prometheus_url, started)


def require_data(prometheus_url: str, what: str, queries: list[tuple[str, str]], started: float) -> None:
    """Wait until every (name, PromQL) query returns a finite sample; fail listing those that do not."""
    missing: list[tuple[str, str]] = []

    def all_have_data() -> bool:
        missing[:] = [q for q in queries if not has_finite_sample(query(prometheus_url, q[1]))]
        return not missing

    try:
        wait_for(f"{what} to return data", all_have_data, 90, interval=2)
    except TimeoutError:
        lines = "\n".join(f"  {name}: {expr}" for name, expr in missing)
        pytest.fail(f"{what}: {len(missing)} of {len(queries)} return no data:\n{lines}")
    print(f"{what}: all {len(queries)} return data; {time.monotonic() - started:.1f}s after the load began")


def check_healthy_cluster(prometheus_url: str, started: float) -> None:
    """Normal traffic only: no panel says "No data", every cbserve series a dashboard selects exists (the
    error counters at 0 for their known label values), and nothing was rejected. (Ray Serve creates its
    error counter at the first error: that panel falls back to 0.)"""
    selectors = [s for s in dashboard_selectors() if s.startswith("ray_cbserve_")]
    assert any(s.startswith("ray_cbserve_request_rejected_total") for s in selectors)
    require_data(prometheus_url, "dashboard series", [(s, s) for s in selectors], started)
    panels = [(f"{d} / {t}", substitute(e)) for d, t, e in dashboard_queries()]
    require_data(prometheus_url, "dashboard queries on a healthy cluster", panels, started)
    rejected = query(prometheus_url, "sum by (reason)(ray_cbserve_request_rejected_total)")
    assert {r["metric"]["reason"]: float(r["value"][1]) for r in rejected} == {"queue_full": 0, "rejected": 0}
    errors = query(prometheus_url, 'sum(ray_cbserve_http_requests_total{route=~"/v1/.*", status!~"2.."})')
    assert errors and float(errors[0]["value"][1]) == 0


def check_dashboards(prometheus_url: str, started: float) -> None:
    panels = [(f"{d} / {t}", substitute(e)) for d, t, e in dashboard_queries()]
    require_data(prometheus_url, "dashboard queries", panels, started)

    # The load left the marks it should: a rejection by the engine, HTTP errors, preemptions happened.
    # (The series existed at 0 before: wait for Ray's export and the next scrape to carry the counts.)
    failures: list[str] = []

    def marks_left() -> bool:
        failures[:] = load_marks(prometheus_url)
        return not failures

    with contextlib.suppress(TimeoutError):
        wait_for("the bad load's marks", marks_left, 60, interval=2)
    assert not failures, failures


def load_marks(prometheus_url: str) -> list[str]:
    """What the load should have counted but did not (empty: all there)."""
    def value(expr: str) -> float:
        result = query(prometheus_url, expr)
        print(expr, "=", result[0]["value"][1] if result else None)
        return float(result[0]["value"][1]) if result else 0.0

    failures = []
    if value('sum(ray_cbserve_request_rejected_total{reason="rejected"})') < 1:
        failures.append("no request rejected by the engine")
    errors = query(prometheus_url, 'sum by (status)(ray_cbserve_http_requests_total{status=~"4.."}) > 0')
    if not {r["metric"]["status"] for r in errors} >= {"400", "404"}:
        failures.append(f"HTTP 400 and 404 not both counted: {errors}")
    if value("sum(ray_cbserve_request_finished_total)") < 7:
        failures.append("fewer than 7 requests finished")
    for expr in (
        "sum(ray_cbserve_num_preemptions_total)",
        "sum(ray_cbserve_prefix_cache_hits_total)",
        "sum(ray_cbserve_request_rejected_total)",
        "sum(ray_serve_num_http_requests_total)",
        "sum(ray_serve_num_http_error_requests_total)",
        "sum(ray_cbserve_spec_decode_num_draft_tokens_total)",
        "sum(ray_cbserve_spec_decode_num_accepted_tokens_total)",
        'sum(ray_cbserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"})',
    ):
        if value(expr) <= 0:
            failures.append(f"{expr} should count what the load did")
    return failures
