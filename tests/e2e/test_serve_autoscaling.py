"""Autoscaling on a real local Ray cluster (``autoscaling``, config/autoscaling.py), with a tiny random Llama
(seconds to load) behind Serve's proxy:

min 0, max 2, a target of 2 requests in flight per replica: the app starts with no replica and a request sent
then waits for the cold start; a burst of streams makes Serve start a second ingress replica (with engines of its
own, named apart from the first's); a trickle afterwards lets it go back to one (the replica stopped drains first,
its engines go with it); idle, it goes back to zero. Every stream of every phase ends complete and alike. A drain
as `cbserve serve` sends it on SIGTERM (a Serve broadcast) reaches the replicas there are.

LoRA adapters with two ingress replicas: one set for both (cluster/stores/lora_store.py). A load or unload through the
proxy (which answers from either) reaches both at once; a replica restarted later serves the same set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import SharedRay, post_text, wait_for
from lora_lib import make_adapter, make_tiny_llama

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(420)]
ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

MODEL = "tiny-llama"
MAX_TOKENS = 32
ARGS = {
    "served_model_name": MODEL, "dtype": "float32", "device": "cpu", "max_model_len": 256,
    "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 4 * 1024**2, "worker_num_cpus": 1,
    "worker_torch_threads": 1, "node_tuning": "off", "shutdown_timeout": 20,
    # a batch starts once its oldest request waited 1 s (the engine sleeps meanwhile): a burst stays in flight for
    # Serve's count while leaving most of the machine's 2 cores to the replica it makes Serve start (a busy engine
    # made that start take 30-45 s instead of 15-25 s)
    "policy": "dynamic", "dynamic_batch_window_s": 1.0,
}  # fmt: skip
# Serve's metrics every 0.5 s over a 1 s window, so the test reacts in seconds, not Serve's default minutes
FAST = "metrics_interval_s=0.5,look_back_period_s=1,upscale_delay_s=0"


@pytest.fixture(scope="module")
def local_serve(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The shared Serve instance's URL and the model; the tests deploy their apps (a failed one's app removed
    after)."""
    model = make_tiny_llama(tmp_path_factory.mktemp("model") / MODEL)
    try:
        yield shared_ray.start(), model
    finally:
        shared_ray.remove(["scale", "loras"])


def _deploy(name: str, model: Path, autoscaling: str) -> None:
    from ray import serve

    from cbserve.cluster.app import build_app

    app = build_app(dict(ARGS, model=str(model), autoscaling=autoscaling))
    serve.run(app, name=name, route_prefix=f"/{name}")  # returns once the app is RUNNING


def _running(name: str) -> int:
    from ray import serve

    app = serve.status().applications.get(name)
    if app is None:
        return 0
    states = app.deployments["OpenAIIngress"].replica_states
    return int(states.get("RUNNING", 0))


def _owners(name: str) -> set[str]:
    """The ingress replicas that own live engine actors of app ``name`` (engine_actor_name's middle part)."""
    from cbserve.cluster.ops.names import engine_actor_names

    return {n.rsplit(":", 2)[1] for n in engine_actor_names(name)}


def _stream(client: Any) -> tuple[str, int, str | None]:
    """One greedy streamed completion: its text, completion tokens and finish reason."""
    stream = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})  # fmt: skip
    text, tokens, reason = "", 0, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, reason


class Load:
    """``concurrency`` threads sending streamed requests back to back until stopped; every outcome is kept."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.results: list[tuple[str, int, str | None]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.results.append(_stream(self.client))
            except Exception as e:  # a lost request: the test fails on it
                self.errors.append(f"{type(e).__name__}: {e}")

    def until(self, what: str, cond: Callable[[], Any], timeout: float) -> None:
        try:
            wait_for(what, cond, timeout, 0.25)
        finally:
            self.stop.set()
            for t in self.threads:
                t.join(timeout=120)

    def check(self, reference: str | None = None) -> str:
        """Nothing lost: no error, every stream complete (all its tokens, finish reason "length"), all alike."""
        assert not self.errors, self.errors[:5]
        assert self.results, "no request completed"
        texts = {text for text, tokens, reason in self.results if tokens == MAX_TOKENS and reason == "length"}
        assert len(texts) == 1 and len(self.results) == sum(1 for r in self.results if r[0] in texts), self.results
        (text,) = texts
        assert reference is None or text == reference
        return text


def test_scales_from_zero_to_two_replicas_under_a_burst_and_back_with_nothing_lost(
    local_serve: tuple[str, Path],
) -> None:
    """One app, min 0 and max 2 ingress replicas, a target of 2 requests in flight per replica: at zero, a request
    waits for the cold start; a burst starts a second replica; a trickle lets it go back to one; idle, to zero."""
    from ray import serve

    url, model = local_serve
    flag = f"min=0,max=2,target_ongoing=2,downscale_delay_s=2,downscale_to_zero_delay_s=4,{FAST}"
    _deploy("scale", model, flag)
    assert _running("scale") == 0 and not _owners("scale")
    client = openai.OpenAI(base_url=f"{url}/scale/v1", api_key="none", max_retries=0, timeout=180)
    started = time.monotonic()
    text, tokens, reason = _stream(client)  # waits in Serve's proxy while a replica and its engines start
    cold_start_s = time.monotonic() - started
    assert tokens == MAX_TOKENS and reason == "length" and _running("scale") == 1 and len(_owners("scale")) == 1
    burst = Load(f"{url}/scale", concurrency=6)  # 6 streams in flight against a target of 2 per replica
    started = time.monotonic()
    burst.until("a second ingress replica", lambda: _running("scale") == 2, 180)
    scale_up_s = time.monotonic() - started
    burst.check(text)
    assert len(_owners("scale")) == 2, "each ingress replica owns engines of its own, named apart"
    trickle = Load(f"{url}/scale", concurrency=1)  # one stream at a time: a load one replica carries
    trickle.until("back to one ingress replica", lambda: _running("scale") == 1, 120)
    # what `cbserve serve` does on SIGTERM reaches the ingress replicas through Serve's broadcast (here, idle, the
    # one left, well within downscale_to_zero_delay_s)
    drained = serve.get_app_handle("scale").broadcast("drain").results(timeout_s=60)
    assert drained and all(d == {"in_flight": 0, "aborted": 0} for d in drained), drained
    trickle.check(text)  # the replica scaled down finished what it had before it went
    wait_for("the stopped replica's engines gone", lambda: len(_owners("scale")) == 1, 60)
    wait_for("scaled to zero", lambda: _running("scale") == 0 and not _owners("scale"), 120)
    print(f"cold start {cold_start_s:.1f}s, scale-up {scale_up_s:.1f}s; {len(burst.results)} + "
          f"{len(trickle.results)} streams complete")
    serve.delete("scale")


def _replica_adapters(name: str) -> list[list[str]]:
    """Each ingress replica's served adapters (``sync_loras`` with nothing new answers them); a replica that
    died shows as its error's name."""
    from ray import serve

    answers = serve.get_app_handle(name).broadcast("sync_loras").results(timeout_s=60, return_exceptions=True)
    return sorted(a if isinstance(a, list) else [type(a).__name__] for a in answers)


def _both_alive(answers: list[list[str]]) -> list[list[str]] | None:
    return answers if len(answers) == 2 and ["ActorDiedError"] not in answers else None


def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    return post_text(url + path, body)


def test_lora_loads_and_unloads_reach_every_ingress_replica_and_a_restarted_one(
    local_serve: tuple[str, Path], tmp_path: Path,
) -> None:
    from ray import serve

    from cbserve.cluster.app import build_app

    url, model = local_serve
    alpha, beta = make_adapter(model, tmp_path / "alpha", seed=1), make_adapter(model, tmp_path / "beta", seed=2)
    app = build_app(dict(ARGS, model=str(model), autoscaling="min=2,max=2", enable_lora=True, max_loras=2,
                         max_lora_rank=8, lora_modules={"alpha": str(alpha)}, allow_runtime_lora_updating=True,
                         lora_allowed_dirs=[str(tmp_path)]))  # fmt: skip
    serve.run(app, name="loras", route_prefix="/loras")
    base = f"{url}/loras"
    assert _replica_adapters("loras") == [["alpha"], ["alpha"]]
    assert _post(base, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(beta)})[0] == 200
    assert _replica_adapters("loras") == [["alpha", "beta"], ["alpha", "beta"]]  # at once, not a period later
    refused = _post(base, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(alpha)})
    assert refused[0] == 400 and "already been loaded" in refused[1], refused
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    texts = {client.completions.create(model="beta", prompt="The weather today is", max_tokens=4,
                                       temperature=0).choices[0].text for _ in range(6)}  # fmt: skip
    assert len(texts) == 1  # both replicas answer beta alike
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "alpha"})[0] == 200
    assert _replica_adapters("loras") == [["beta"], ["beta"]]
    for _ in range(6):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="alpha", prompt="hi", max_tokens=2)
    # a replica that starts later (here: Serve replaces a killed one) serves the app's set, not lora_modules'
    (victim, *_) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if "loras#OpenAIIngress" in a["name"]]  # fmt: skip
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    wait_for("the killed replica replaced", lambda: _running("loras") == 2 and victim not in {
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}, 180)  # fmt: skip
    # (the test's handle learns of the new replica within seconds; until then it names the dead one, or one)
    answers = wait_for("both replicas answering", lambda: _both_alive(_replica_adapters("loras")), 60)
    assert answers == [["beta"], ["beta"]]
    serve.delete("loras")
