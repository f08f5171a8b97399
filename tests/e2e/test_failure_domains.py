"""Failure domains, end to end: one bad request of each kind against two engine replicas with innocent streams
running, through the real OpenAI client and HTTP server on a real local Ray. The model is the fault-injection
tiny Llama (``tests/tiny_llama.py``, ``cbserve/worker/faults.py``): its worker fails when token ``TRIGGER`` runs.

- ``forward``: a prompt that breaks the forward pass (the worker names nobody: the engine finds the culprit), and
  a stream that breaks mid-decode (``logit_bias`` makes it generate the trigger): the culprit gets a clear error
  within 5 s (a 500 before its first token, an SSE error event after), every innocent stream completes with the
  tokens of the offline reference, no replica rebuilds, every KV block is free after.
- ``mask``: a request whose structured-output matcher raises (named by the worker): the same, at once.
- ``exit``: a prompt that kills the process its rank runs in (the engine actor's, at tensor-parallel size 1): its
  replica is lost and restarted, the request is retried on the other replica, which it kills too, and is then
  failed as a suspect (a 500), not retried a third time; both replicas come back. An engine process killed with
  SIGKILL is noticed within 2 s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import SharedRay, wait_for
from tiny_llama import TRIGGER, make_fault_model

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 256, "max_num_seqs": 16,
        "num_replicas": 2, "worker_num_cpus": 0.5, "worker_torch_threads": 1, "kv_cache_memory_bytes": 4 * 1024**2,
        "node_tuning": "off", "served_model_name": "faulty", "routing": "round_robin"}  # fmt: skip
INNOCENT = [[1, 300 + 7 * i, 412, 5000 + 13 * i, 77, 901 + i] for i in range(7)]
MAX_TOKENS = 200


class Faults:
    def __init__(self, base: str, models: dict[str, Path]) -> None:
        self.base, self.models = base, models

    def client(self, app: str) -> Any:
        return openai.OpenAI(base_url=f"{self.base}/{app}/v1", api_key="none", max_retries=0, timeout=120)

    def stats(self, app: str) -> dict[str, dict[str, Any]]:
        import json
        import urllib.request

        with urllib.request.urlopen(f"{self.base}/{app}/stats", timeout=30) as r:
            return {d["replica"]: d for d in json.loads(r.read())["replicas"]}


@pytest.fixture(scope="module")
def faults(shared_ray: SharedRay, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    folder = tmp_path_factory.mktemp("faults")
    models = {point: make_fault_model(folder / point, point) for point in ("forward", "mask", "exit")}
    apps = {point: dict(ARGS, model=str(path), app_name=point) for point, path in models.items()}
    with shared_ray.apps(apps) as base:
        f = Faults(base, models)
        for point in models:
            wait_for(f"{point} ready", lambda p=point: all(r["state"] == "ready" for r in f.stats(p).values()), 300)
        yield f


@pytest.fixture(scope="module")
def reference(faults: Faults) -> list[str]:
    """The innocents' greedy texts from the offline ``LLM`` on the same model."""
    from cbserve import LLM, SamplingParams

    llm = LLM(str(faults.models["forward"]), dtype="float32", device="cpu", max_model_len=256,
              kv_cache_memory_bytes=4 * 1024**2, progress=False)  # fmt: skip
    outs = llm.generate(INNOCENT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


def _innocent(client: Any, prompt: list[int]) -> tuple[str, str | None, int]:
    """One streamed greedy completion: (text, finish reason, chunks with text)."""
    text, finish, chunks = "", None, 0
    for c in client.completions.create(model="faulty", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
        text += c.choices[0].text
        chunks += bool(c.choices[0].text)
        finish = c.choices[0].finish_reason or finish
    return text, finish, chunks


def _with_innocents(faults: Faults, app: str, reference: list[str] | None, poison: Any) -> Any:
    """Run the innocent streams on ``app``, then ``poison(client)`` once both replicas hold streams; the
    innocents must all complete (with ``reference``'s texts when given). Returns what ``poison`` returned."""
    client = faults.client(app)
    generations = {r: s["generation"] for r, s in faults.stats(app).items()}
    with ThreadPoolExecutor(len(INNOCENT)) as pool:
        streams = [pool.submit(_innocent, client, p) for p in INNOCENT]
        wait_for("streams on both replicas", lambda: all(s["num_in_flight"] for s in faults.stats(app).values()),
                 60, 0.05)  # fmt: skip
        result = poison(client)
        done = [s.result(timeout=300) for s in streams]
    assert all(finish == "length" for _, finish, _ in done), done
    if reference is not None:
        assert [text for text, _, _ in done] == reference
    stats = faults.stats(app)
    assert {r: s["generation"] for r, s in stats.items()} == generations  # no replica rebuilt
    wait_for("every KV block free", lambda: all(s["num_free_kv_blocks"] == s["num_kv_blocks"]
                                                for s in faults.stats(app).values()), 30)  # fmt: skip
    return result


def _timed_error(call: Any) -> tuple[Any, float]:
    start = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        call()
    return e.value, time.monotonic() - start


def test_a_prompt_that_breaks_the_forward_pass_fails_alone(faults: Faults, reference: list[str]) -> None:
    def poison(client: Any) -> tuple[Any, float]:
        return _timed_error(lambda: client.completions.create(model="faulty", prompt=[1, 42, TRIGGER, 43],
                                                              max_tokens=8, temperature=0))

    error, seconds = _with_innocents(faults, "forward", reference, poison)
    assert isinstance(error, openai.InternalServerError) and "injected fault" in str(error), error
    assert seconds < 5.0


def test_a_stream_that_breaks_mid_decode_gets_an_error_event_after_its_first_token(
    faults: Faults, reference: list[str]
) -> None:
    def poison(client: Any) -> tuple[list[str], Any]:
        texts: list[str] = []
        with pytest.raises(openai.APIError) as e:
            for c in client.completions.create(model="faulty", prompt=[1, 42, 43, 44], max_tokens=8, temperature=0,
                                               stream=True, logit_bias={str(TRIGGER): 100}):  # fmt: skip
                texts.append(c.choices[0].text)
        return texts, e.value

    texts, error = _with_innocents(faults, "forward", reference, poison)
    assert len([t for t in texts if t]) == 1 and "injected fault" in str(error), (texts, error)


def test_a_broken_structured_output_mask_fails_its_request_alone(faults: Faults) -> None:
    def poison(client: Any) -> tuple[Any, float]:
        return _timed_error(lambda: client.completions.create(
            model="faulty", prompt=[1, 42, TRIGGER], max_tokens=8, temperature=0,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}}))

    error, seconds = _with_innocents(faults, "mask", None, poison)
    assert isinstance(error, openai.InternalServerError) and "structured-output mask" in str(error), error
    assert seconds < 5.0
    assert sum(s["num_failed_steps"] for s in faults.stats("mask").values()) == 1  # named: no search


def test_a_request_that_kills_two_replicas_is_failed_as_a_suspect(faults: Faults) -> None:
    client = faults.client("exit")
    generations = {r: s["generation"] for r, s in faults.stats("exit").items()}
    error, _ = _timed_error(lambda: client.completions.create(model="faulty", prompt=[1, 42, TRIGGER],
                                                              max_tokens=8, temperature=0))
    assert isinstance(error, openai.InternalServerError) and "not retried again" in str(error), error
    wait_for("both replicas rebuilt", lambda: all(
        s["state"] == "ready" and s["generation"] > generations[r] for r, s in faults.stats("exit").items()), 240)
    out = client.completions.create(model="faulty", prompt=INNOCENT[0], max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"


def test_a_killed_engine_process_is_noticed_within_two_seconds(faults: Faults) -> None:
    stats = faults.stats("exit")
    wait_for("ready", lambda: all(s["state"] == "ready" for s in faults.stats("exit").values()), 240)
    replica, before = "0", stats["0"]
    os.kill(before["engine_pids"][0], signal.SIGKILL)  # its engine process, where its one rank runs
    start = time.monotonic()
    wait_for("the loss noticed", lambda: faults.stats("exit")[replica]["generation"] > before["generation"]
             or faults.stats("exit")[replica]["state"] != "ready", 30, 0.05)  # fmt: skip
    assert time.monotonic() - start < 2.0
    wait_for("rebuilt", lambda: faults.stats("exit")[replica]["state"] == "ready", 240)
