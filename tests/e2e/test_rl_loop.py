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
from e2e_lib import SharedRay
from lora_lib import PROJECTIONS

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
def served(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from tiny_llama import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("rl") / "tiny")
    apps = {"tp1": dict(BASE, model=str(folder), enable_lora=True, max_lora_rank=8),
            "tp2": dict(BASE, model=str(folder), tensor_parallel_size=2)}
    with shared_ray.apps(apps) as url:
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
    version = client.completions.create(prompt=PROMPTS[0], **ask).model_extra["weights_version"]
    got: dict[int, list[str]] = {i: [] for i in range(len(PROMPTS))}
    versions: dict[int, Any] = {}

    def stream(i: int) -> None:
        for chunk in client.completions.create(prompt=PROMPTS[i], stream=True, **ask):
            got[i].append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason is not None:  # the chunk that ends the choice names the weights
                versions[i] = chunk.model_extra.get("weights_version")
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
    assert versions == {i: version for i in range(len(PROMPTS))} and isinstance(version, int)

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


def _peft_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_lora_adapter_pushed_in_place_serves_the_trainers_weights(served: tuple[str, Path]) -> None:
    """A trainer's adapter, pushed as tensors (no files) and pushed again under its name after a change: each time the
    served greedy tokens equal HF + PEFT's with the adapter as pushed (a block cached with the old one would show:
    the prompt is the same), and the new push has a new id."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from cbserve.rl.engines import RolloutEngines

    url, folder = served
    example = _example()
    client = openai.OpenAI(base_url=f"{url}/tp1/v1", api_key="none", max_retries=0, timeout=120)
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    engines = RolloutEngines("tp1")
    engines.update_weights(base.state_dict())  # the folder's weights again, whatever the loop test pushed
    plain = example.greedy_tokens(client, "tiny", CHECK, 8)[0]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS, init_lora_weights=False)
    policy = get_peft_model(base, config).eval()
    answers, served_tokens = [], []
    for _ in range(2):
        answers.append(engines.load_lora_adapter("policy", get_peft_model_state_dict(policy), config))
        served_tokens.append(example.greedy_tokens(client, "policy", CHECK, 8)[0])
        assert served_tokens[-1] == _peft_greedy(policy, CHECK, 8)
        with torch.no_grad():  # the trainer's step: the adapter changes
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.mul_(-3.0)
    assert served_tokens[0] != plain and served_tokens[1] != served_tokens[0], "the adapters changed nothing"
    assert answers[1]["lora_int_id"] > answers[0]["lora_int_id"] and answers[1]["digest"] != answers[0]["digest"]
    assert [m.id for m in client.models.list().data].count("policy") == 1
    with pytest.raises(Exception, match="rank 16 is over max_lora_rank 8"):
        big = LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj"], init_lora_weights=False)
        fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32), big)
        engines.load_lora_adapter("too-big", get_peft_model_state_dict(fresh), big)
