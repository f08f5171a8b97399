"""The apps of this package's tests, served by the shared Ray instance (``shared_ray``, tests/e2e/conftest.py). For
every test (package scope: removed before other modules deploy theirs):

- ``main`` at ``/``: the bundled SmolLM2-135M, 2 engine replicas of tensor-parallel size 1, an API key;
- ``lora`` at ``/lora``: a tiny random Llama with LoRA on (``enable_lora``, two random rank-8 PEFT adapters in
  ``lora_modules``, ``max_loras`` 2, ``max_lora_rank`` 256; ``lora_lib.py``) and runtime loading allowed from the
  folder of its files, one replica (test_lora.py).

For the module that asks for it (``tp2``: test_tp2.py), deployed as it starts and removed as it ends:

- ``tp2`` at ``/tp2``: SmolLM2 cut to 4 layers / 6 heads / 2 KV heads (so it splits over 2 ranks), one
  replica of tensor-parallel size 2 over a Ray compiled graph, one running sequence and a waiting queue of one (for
  the 429 test). Idle, a compiled graph's readers poll their shared-memory channels (Ray's ReadAcquire spins on
  sched_yield): its scheduler and two workers would hold about 1.5 of 2 cores while every other test ran.

The reference greedy outputs come from the in-process offline ``LLM`` with the same engine settings.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import SharedRay, derive_tp2_model, wait_for
from lora_lib import make_adapter, make_tiny_llama

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

API_KEY = "e2e-secret"
MAIN_MODEL = "SmolLM2-135M-Instruct"
TP2_MODEL = "smollm2-tp2"
MAX_MODEL_LEN = 512
COMMON = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_batched_tokens": 512,
    "worker_num_cpus": 1,
    "worker_torch_threads": 1,
}
MAIN_ARGS = dict(COMMON, num_replicas=2, max_num_seqs=32, kv_cache_memory_bytes=48 * 1024**2, api_key=API_KEY)
TP2_ARGS = dict(
    COMMON, tensor_parallel_size=2, served_model_name=TP2_MODEL, max_num_seqs=1, max_waiting=1,
    kv_cache_memory_bytes=16 * 1024**2, use_compiled_graph=True,  # "auto" would pick actor calls on CPU
)
LORA_MODEL = "tiny-llama"
LORA_ARGS = dict(COMMON, served_model_name=LORA_MODEL, max_num_seqs=8, kv_cache_memory_bytes=8 * 1024**2,
                 enable_lora=True, max_loras=2, max_lora_rank=256, allow_runtime_lora_updating=True)  # fmt: skip
READY_TIMEOUT_S = 420


@dataclass
class App:
    base_url: str  # http://host:port/prefix (no trailing slash)
    model: str
    api_key: str | None

    def client(self, **kwargs: Any) -> Any:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", **kwargs)

    def http(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None, key: str | None = "default"
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        token = self.api_key if key == "default" else key
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            payload = e.read()
            try:
                return e.code, json.loads(payload or b"null")
            except json.JSONDecodeError:
                return e.code, payload.decode(errors="replace")

    def healthy(self) -> bool:
        return self.http("GET", "/health")[0] == 200

    def stats(self) -> dict[str, dict[str, Any]]:
        status, body = self.http("GET", "/stats")
        assert status == 200, body
        return {r["replica"]: r for r in body["replicas"]}


@dataclass
class Server:
    main: App
    tp2_model_path: Path
    expected: dict[str, str]  # reference greedy texts, keyed like the tests ask for them
    lora: App
    lora_paths: dict[str, Path]  # the tiny Llama ("model"), its adapters by name, their folder ("root")


def _reference(tp2_model: Path) -> dict[str, str]:
    """Greedy outputs of the offline LLM (one request at a time, as the tests send them)."""
    import torch

    from cbserve import LLM, SamplingParams

    from .cases import CHAT, MAX_TOKENS, PROMPTS

    torch.set_num_threads(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out: dict[str, str] = {}
    engine_kw = {k: COMMON[k] for k in ("dtype", "device", "max_model_len", "max_num_batched_tokens")}
    llm = LLM(kv_cache_memory_bytes=48 * 1024**2, progress=False, **engine_kw)
    for p in PROMPTS:
        out[f"main:{p}"] = llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].text
    out["main:chat"] = llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    llm = LLM(str(tp2_model), kv_cache_memory_bytes=16 * 1024**2, progress=False, **engine_kw)
    for p in PROMPTS:
        out[f"tp2:{p}"] = llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].text
    llm.shutdown()
    return out


def _lora_files(folder: Path) -> dict[str, Path]:
    """The tiny Llama and four random adapters of it: alpha and beta served from the start, gamma and delta (of
    rank 256) loaded by the tests."""
    import torch

    torch.set_num_threads(1)
    model = make_tiny_llama(folder / LORA_MODEL)
    adapters = {name: make_adapter(model, folder / name, seed) for seed, name in enumerate(("alpha", "beta", "gamma"))}
    adapters["delta"] = make_adapter(model, folder / "delta", 3, rank=256)
    return {"root": folder, "model": model, **adapters}


@pytest.fixture(scope="package")
def server(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from ray import serve
    from ray.serve.api import RunTarget

    from cbserve.cluster.app import build_app

    lora_paths = _lora_files(tmp_path_factory.mktemp("lora"))
    lora_args = dict(LORA_ARGS, model=str(lora_paths["model"]), lora_allowed_dirs=[str(lora_paths["root"])],
                     lora_modules=[f"{name}={lora_paths[name]}" for name in ("alpha", "beta")])  # the flags' form
    base = shared_ray.start()
    try:
        serve.run_many(
            [
                RunTarget(build_app(MAIN_ARGS), name="main", route_prefix="/"),
                RunTarget(build_app(lora_args), name="lora", route_prefix="/lora"),
            ],
            wait_for_applications_running=False,
        )
        tp2_model = derive_tp2_model(tmp_path_factory.mktemp("model") / TP2_MODEL)  # while the apps start
        expected = _reference(tp2_model)
        srv = Server(App(base, MAIN_MODEL, API_KEY), tp2_model, expected, App(f"{base}/lora", LORA_MODEL, None),
                     lora_paths)  # fmt: skip
        wait_for("the apps healthy", lambda: srv.main.healthy() and srv.lora.healthy(), READY_TIMEOUT_S)
        yield srv
    finally:
        shared_ray.remove(["main", "lora"])


@pytest.fixture(scope="module")
def tp2(server: Server, shared_ray: SharedRay) -> Iterator[App]:
    """The ``tp2`` app (see above), for the module that asks for it only."""
    with shared_ray.apps({"tp2": dict(TP2_ARGS, model=str(server.tp2_model_path))}, ready_s=READY_TIMEOUT_S) as base:
        yield App(f"{base}/tp2", TP2_MODEL, None)
