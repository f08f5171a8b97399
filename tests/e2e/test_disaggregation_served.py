"""Prefill/decode disaggregation served: the bundled model behind the real HTTP server on a real local Ray, as a P:D
app of one prefill and one decode engine replica (``disaggregation: "1:1"``) over a shared-memory folder. A prompt
long enough runs on the prefill replica first and its decode replica pulls the blocks: the greedy tokens (streamed
and not, completions and chat) equal the offline engine's; a short prompt is prefilled on its decode replica; a
vLLM-style proxy drives the handshake over HTTP itself (``kv_transfer_params``); and with both replicas' processes
killed under load, every request still ends with the offline tokens (none lost, no stream cut)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from e2e_lib import SharedRay

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

BASE = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 8, "worker_num_cpus": 1,
        "kv_cache_memory_bytes": 24 * 1024**2, "node_tuning": "off", "kv_offloading_size": 0.125}  # fmt: skip
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 10
TOPICS = ["the sea", "mountains", "a city at night", "an old library"]


def _prompt(topic: str) -> str:
    return " ".join(f"Here is a long note about {topic}, line {i}, which the assistant should keep in mind."
                    for i in range(8)) + "\nWrite one more line:"  # fmt: skip


# the prompts the tests send (their offline texts are computed while the app starts)
KILLED = [_prompt(f"{t}, take {k}") for k in range(3) for t in TOPICS]
PROMPTS = [*map(_prompt, TOPICS[:3]), "Say hi.", _prompt("a quiet harbour"), *KILLED]


def _stats(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        return json.loads(r.read())["replicas"]


@pytest.fixture(scope="module")
def offline() -> Any:
    """The offline engine's greedy text of a prompt (each computed once)."""
    from cbserve import LLM, SamplingParams

    llm = LLM(None, progress=False, **{k: v for k, v in BASE.items() if k not in ("worker_num_cpus", "node_tuning",
                                                                                   "kv_offloading_size")})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts: dict[str, str] = {}

    def text(prompt: str) -> str:
        if prompt not in texts:
            texts[prompt] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        return texts[prompt]

    return text


@pytest.fixture(scope="module")
def served(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory, offline: Any) -> Iterator[str]:
    """The P:D app's URL; the offline texts of this module's prompts are computed while it starts."""
    pd = {"prefill_replicas": 1, "decode_replicas": 1, "min_remote_prefill_tokens": 64,
          "shm_path": str(tmp_path_factory.mktemp("shm"))}  # fmt: skip
    with shared_ray.apps({"pd": dict(BASE, disaggregation=pd)}, {"pd": "/"},
                         meanwhile=lambda: [offline(p) for p in PROMPTS]) as url:  # fmt: skip
        yield url


def _complete(client: Any, prompt: str, stream: bool = False, **extra: Any) -> Any:
    body = {"ignore_eos": True, **extra}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream,
                                  extra_body=body)  # fmt: skip
    return "".join(c.choices[0].text for c in r) if stream else r


def test_long_prompts_are_prefilled_remotely_with_the_offline_tokens(served: str, offline: Any) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120)
    for i, topic in enumerate(TOPICS[:3]):
        text = _complete(client, _prompt(topic), stream=i % 2 == 1)
        assert (text if isinstance(text, str) else text.choices[0].text) == offline(_prompt(topic))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _prompt(TOPICS[3])}],
                                          max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.choices[0].message.content
    prefill, decode = _stats(served)
    assert prefill["kv_tiers"]["blocks_stored"] > 0 and prefill["kv_tiers"]["blocks_pulled"] == 0
    assert decode["kv_tiers"]["blocks_pulled"] > 0 and decode["kv_tiers"]["hit_tokens_remote"] >= 4 * 16 * 4
    assert decode["kv_tiers"]["pull_failures"] == 0
    before = decode["kv_tiers"]["blocks_pulled"]
    assert _complete(client, "Say hi.").choices[0].text == offline("Say hi.")  # short: prefilled on its decode replica
    assert _stats(served)[1]["kv_tiers"]["blocks_pulled"] == before


def test_a_proxy_drives_the_handshake_over_http(served: str, offline: Any) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120)
    prompt = _prompt("a quiet harbour")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    answer = first.model_extra["kv_transfer_params"]
    assert answer["do_remote_prefill"] is True and len(answer["remote_block_ids"]) >= 4
    pulled = _stats(served)[1]["kv_tiers"]["blocks_pulled"]
    assert _complete(client, prompt, kv_transfer_params=answer).choices[0].text == offline(prompt)
    assert _stats(served)[1]["kv_tiers"]["blocks_pulled"] >= pulled + len(answer["remote_block_ids"]) - 1
    with pytest.raises(openai.BadRequestError, match="remote_engine_id"):
        _complete(client, prompt, kv_transfer_params={**answer, "remote_engine_id": "../../etc"})


def test_killing_both_replicas_under_load_loses_and_cuts_no_request(served: str, offline: Any) -> None:
    """The chaos run: the prefill and the decode replica's processes killed while requests prefill and stream (as soon
    as a stream has its second token). A prompt whose prefill leg is lost is prefilled on its decode replica; a stream
    whose decode replica is lost goes on as a continuation once Ray restarted it (failover.py): every request ends
    with the offline tokens, none repeated, none missing."""
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=180)
    prompts = KILLED
    pids = [r["engine_pids"][0] for r in _stats(served)]
    streaming = threading.Event()

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        text = []
        for chunk in chunks:
            text.append(chunk.choices[0].text)
            if len(text) == 2:
                streaming.set()
        return "".join(text)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, p) for p in prompts]
        assert streaming.wait(60)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        texts = [f.result() for f in futures]
    assert texts == [offline(p) for p in prompts]  # (the module's teardown stops the replicas Ray restarts)
