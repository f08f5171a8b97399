"""The KV tiers served: the bundled model behind the real HTTP server on a real local Ray, one engine replica with a
KV pool smaller than its conversations, a RAM tier and a disk tier (``kv_offloading_size``, ``kv_disk_path``,
``kv_disk_size``). Second turns, whose first turns' blocks the pool evicted, come back from the RAM tier with the
offline engine's greedy tokens (no tiers there); then the engine's process is killed, Ray restarts it with an empty
pool and RAM tier, and the third turns come from the disk tier, with the offline engine's tokens again."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import SharedRay, wait_for

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

BASE = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 8, "num_replicas": 1,
        "worker_num_cpus": 1, "kv_cache_memory_bytes": 24 * 1024**2, "node_tuning": "off"}  # fmt: skip
TOPICS = ["the sea", "mountains", "a city at night", "an old library", "the desert", "a small garden"]
MAX_TOKENS = 12


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        return json.loads(r.read())["replicas"][0]


@pytest.fixture(scope="module")
def served(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict]]:
    """The app's URL, its disk tier's folder, and the offline engine's three turns of each topic (run while the app
    starts)."""
    disk = tmp_path_factory.mktemp("kv-disk")
    args = dict(BASE, kv_offloading_size=0.25, kv_disk_path=str(disk), kv_disk_size=0.5)
    offline: dict[str, list[str]] = {t: [] for t in TOPICS}
    with shared_ray.apps({"tiers": args}, {"tiers": "/"}, meanwhile=lambda: _offline_turns(offline)) as url:
        yield url, disk, offline


def _offline_turns(histories: dict[str, list[str]]) -> None:
    """Three turns of each topic on the offline engine (no tiers there)."""
    from cbserve import LLM, SamplingParams

    llm = LLM(None, progress=False, **{k: v for k, v in BASE.items() if k not in ("num_replicas", "worker_num_cpus",
                                                                                   "node_tuning")})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(3):
        _turn(lambda p: llm.generate([p], params, use_tqdm=False)[0].outputs[0].text, histories)
    llm.shutdown()


def _prompt(topic: str, turns: list[str]) -> str:
    opening = " ".join(f"Here is a long note about {topic}, line {i}, which the assistant should keep in mind."
                       for i in range(12))  # fmt: skip
    return opening + "".join(f"\nUser: tell me more.\nAssistant:{t}" for t in turns) + "\nUser: go on.\nAssistant:"


def _turn(complete: Any, histories: dict[str, list[str]]) -> None:
    for topic, turns in histories.items():
        turns.append(complete(_prompt(topic, turns)))


def test_tiered_turns_give_the_offline_tokens_from_ram_then_from_disk_after_a_restart(
    served: tuple[str, Path, dict]
) -> None:
    url, disk, offline = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    online = {t: [] for t in TOPICS}

    def ask(prompt: str) -> str:
        r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        return r.choices[0].text

    _turn(ask, online)
    _turn(ask, online)
    tiers = _stats(url)["kv_tiers"]
    assert tiers["hit_tokens_ram"] > 0 and tiers["blocks_stored"] > 0
    pid = _stats(url)["engine_pids"][0]
    wait_for("the disk writes", lambda: len(list(disk.rglob("*.kv"))) >= tiers["blocks_stored"], 60)
    os.kill(pid, signal.SIGKILL)
    wait_for("the engine restarted", lambda: (s := _stats(url)).get("state") == "ready"
             and s["engine_pids"] != [pid], 240)  # fmt: skip
    _turn(ask, online)
    assert online == offline
    assert _stats(url)["kv_tiers"]["hit_tokens_disk"] > 0
