"""cbserve as the rollout engine of an RL loop, on a real local Ray behind the real HTTP server: the example's loop
(examples/rl_loop.py: rollouts over the OpenAI client, a trainer actor's REINFORCE steps in HF transformers, its
weights pushed after each) on a tiny model at tensor-parallel size 1 (through the object store) and 2 (through a
gloo weight group), prefix caching on; after every push cbserve's greedy tokens equal HF's with the trainer's
weights, token for token, and the responses name the weights' version. Then the controls over HTTP: pause "keep"
holds streams in flight and resume loses no token; sleep frees the KV cache and wake_up serves again."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import local_serve_apps

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

BASE = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 8, "num_replicas": 1,
        "worker_num_cpus": 1, "kv_cache_memory_bytes": 16 * 1024**2, "node_tuning": "off",
        "served_model_name": "tiny", "enable_sleep_mode": True}  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30, 40, 50], [100, 200, 300, 400, 500, 600]]
CHECK = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # shares its first block with a rollout prompt: a stale prefix hit would show


def _example() -> Any:
    path = Path(__file__).parents[2] / "examples" / "rl_loop.py"
    spec = importlib.util.spec_from_file_location("rl_loop", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from tiny_llama import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("rl") / "tiny")
    apps = {"tp1": dict(BASE, model=str(folder)), "tp2": dict(BASE, model=str(folder), tensor_parallel_size=2)}
    with local_serve_apps(apps) as url:
        yield url, folder


@pytest.mark.parametrize(("app", "transport"), [("tp1", "object_store"), ("tp2", "group")])
def test_rl_loop_served_greedy_equals_hf_after_every_push(served: tuple[str, Path], app: str, transport: str) -> None:
    url, folder = served
    example = _example()
    trainer = example.Trainer.remote(str(folder), app, target_token=1000, transport=transport)
    initial = ray.get(trainer.greedy.remote(CHECK, 8))
    history = example.run_loop(f"{url}/{app}", app, trainer, "tiny", PROMPTS, steps=3, check=CHECK)
    for step, record in enumerate(history, 1):
        assert record["cbserve"] == record["hf"], f"step {step}: served greedy differs from HF's"
        assert record["version"] == record["served_version"] == step
        assert record["rollout_versions"] == [step - 1]  # each rollout came from the previous push's weights
    assert any(r["hf"] != initial for r in history), "the trainer's steps changed nothing"
    ray.kill(trainer)


def _post(url: str, path: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + path, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def test_pause_keep_then_resume_loses_no_token_and_sleep_frees_then_wakes(served: tuple[str, Path]) -> None:
    url = served[0] + "/tp1"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"model": "tiny", "max_tokens": 48, "temperature": 0, "extra_body": {"ignore_eos": True}}
    expected = [client.completions.create(prompt=p, **ask).choices[0].text for p in PROMPTS]
    got: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}

    def stream(i: int) -> None:
        for chunk in client.completions.create(prompt=PROMPTS[i], stream=True, **ask):
            got[i].append(chunk.choices[0].text)
            time.sleep(0.01)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    status, body = _post(url, "/pause?mode=keep")
    assert status == 200 and body["replicas"][0]["paused"] and _get(url, "/is_paused")["is_paused"]
    time.sleep(0.5)
    held = {i: len(c) for i, c in got.items()}
    time.sleep(1.0)
    assert {i: len(c) for i, c in got.items()} == held  # paused: no token comes
    assert _post(url, "/resume")[0] == 200 and not _get(url, "/is_paused")["is_paused"]
    for t in threads:
        t.join(timeout=120)
    assert ["".join(got[i]) for i in range(len(PROMPTS))] == expected

    assert _post(url, "/sleep?level=3")[0] == 400
    status, body = _post(url, "/sleep?level=1")
    replica = body["replicas"][0]
    assert status == 200 and replica["sleeping"] == ["kv_cache"] and _get(url, "/is_sleeping")["is_sleeping"]
    assert replica["rss_freed"] >= 0.9 * replica["kv_cache_bytes"] > 0
    late: list[str] = []
    waiter = threading.Thread(target=lambda: late.append(client.completions.create(prompt=PROMPTS[0], **ask)
                                                         .choices[0].text))  # fmt: skip
    waiter.start()
    time.sleep(0.5)
    assert not late  # asleep: it waits
    status, body = _post(url, "/wake_up")
    assert status == 200 and body["replicas"][0]["sleeping"] == [] and not _get(url, "/is_sleeping")["is_sleeping"]
    waiter.join(timeout=120)
    assert late == [expected[0]]
    status, body = _post(url, "/reset_prefix_cache")
    assert status == 200 and body["replicas"][0]["forgotten_blocks"] > 0
