"""Multi-LoRA serving through the HTTP server and the official client (the ``lora`` app: a tiny random Llama
with two random rank-8 PEFT adapters from ``lora_modules``, slots of ``max_lora_rank`` 256): a request's ``model``
names an adapter, the greedy answers of the base and of every adapter, sent at once (one mixed batch), equal the
offline ``LLM``'s with the same ``LoRARequest`` (itself checked against HF + PEFT in tests/worker), and the
adapters change the answers; ``/v1/models`` lists them under the base; an unknown model is a 404; adapters are
loaded and unloaded while requests run (a request in flight finishes with its adapter; later ones get a 404); a
rank-256 adapter loaded at run time serves from the bytes checked when it was loaded, its folder changed or
deleted since; a path outside ``lora_allowed_dirs``, missing, or not an adapter gets one 400 that names no path;
an app without runtime loading answers the routes 404, behind its API key."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import post_text

from .cases import PROMPTS
from .conftest import COMMON, LORA_ARGS, LORA_MODEL, App, Server

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

MAX_TOKENS = 8
LONG = 160  # tokens of the streams that run while adapters are loaded and unloaded


@pytest.fixture(scope="module")
def expected(server: Server) -> dict[tuple[str, str], str]:
    """The offline LLM's greedy texts, keyed (model name, prompt); adapters with the ids the server gives them."""
    import torch

    from cbserve import LLM, LoRARequest, SamplingParams

    torch.set_num_threads(1)
    paths = server.lora_paths
    kw = {k: COMMON[k] for k in ("dtype", "device", "max_model_len", "max_num_batched_tokens")}
    llm = LLM(str(paths["model"]), enable_lora=True, max_loras=2, max_lora_rank=LORA_ARGS["max_lora_rank"],
              kv_cache_memory_bytes=LORA_ARGS["kv_cache_memory_bytes"], progress=False, **kw)  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out: dict[tuple[str, str], str] = {}
    try:
        for i, name in enumerate((None, "alpha", "beta", "gamma", "delta")):
            lora = None if name is None else LoRARequest(name, i, str(paths[name]))
            for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, greedy, lora_request=lora, use_tqdm=False),
                                      strict=True):  # fmt: skip
                out[(name or LORA_MODEL, prompt)] = result.outputs[0].text
    finally:
        llm.shutdown()
    return out


def _complete(client: Any, model: str, prompt: str | list[str], **kw: Any) -> Any:
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **kw)


def test_adapters_answer_as_offline_in_one_mixed_batch_and_differ_from_the_base(
    server: Server, expected: dict[tuple[str, str], str]
) -> None:
    client = server.lora.client()
    cases = [(model, p) for model in (LORA_MODEL, "alpha", "beta") for p in PROMPTS]
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: base and adapter rows in the same steps
        answers = list(pool.map(lambda c: _complete(client, *c), cases))
    got = {case: r.choices[0].text for case, r in zip(cases, answers, strict=True)}
    assert got == {case: expected[case] for case in cases}
    assert [r.model for r in answers] == [model for model, _ in cases]  # answered under the adapter's name
    for p in PROMPTS:
        assert len({got[(LORA_MODEL, p)], got[("alpha", p)], got[("beta", p)]}) == 3, got
    both = _complete(client, "beta", PROMPTS)  # a batch of prompts: each runs with the adapter
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [expected[("beta", p)] for p in PROMPTS]
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "alpha" and chat.usage.completion_tokens > 0
    response = client.responses.create(model="beta", input="Hi", max_output_tokens=4)
    assert response.model == "beta" and response.usage.output_tokens > 0


def test_models_lists_the_adapters_and_an_unknown_model_is_a_404(server: Server) -> None:
    client = server.lora.client()
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [LORA_MODEL, "alpha", "beta"]
    for name in ("alpha", "beta"):
        card = cards[name].model_dump()
        assert (card["parent"], card["root"]) == (LORA_MODEL, str(server.lora_paths[name]))
    assert client.models.retrieve("alpha").id == "alpha"
    with pytest.raises(openai.NotFoundError) as info:
        _complete(client, "gamma", "Hi")  # not loaded (yet)
    assert "gamma" in info.value.message
    load = {"lora_name": "x", "lora_path": "/x"}
    status, body = server.main.http("POST", "/v1/load_lora_adapter", load)  # the main app: no LoRA, runtime off
    assert status == 404 and "--allow-runtime-lora-updating" in body["error"]["message"]
    assert server.main.http("POST", "/v1/load_lora_adapter", load, key=None)[0] == 401  # its API key first


def _post(app: App, path: str, body: dict[str, str]) -> tuple[int, str]:
    """The status and text of a POST (the adapter routes answer success as text, errors as OpenAI's JSON)."""
    return post_text(app.base_url + path, body)


def _stream(client: Any, model: str, started: threading.Event) -> int:
    """A greedy stream of LONG tokens; its final usage's completion tokens."""
    chunks = client.completions.create(model=model, prompt="Tell a long story.", max_tokens=LONG, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})  # fmt: skip
    tokens = 0
    for chunk in chunks:
        if chunk.choices:
            started.set()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


@pytest.fixture
def in_flight(server: Server) -> Iterator[Any]:
    """Start streams in the background: ``in_flight(model)`` returns its future once its first token came."""
    client = server.lora.client()
    with ThreadPoolExecutor(4) as pool:

        def start(model: str) -> Any:
            started = threading.Event()
            future = pool.submit(_stream, client, model, started)
            assert started.wait(120) or future.result()
            return future

        yield start


def test_load_and_unload_while_requests_run(
    server: Server, expected: dict[tuple[str, str], str], in_flight: Any
) -> None:
    app, client, gamma = server.lora, server.lora.client(), str(server.lora_paths["gamma"])
    base_stream = in_flight(LORA_MODEL)
    load, unload = {"lora_name": "gamma", "lora_path": gamma}, {"lora_name": "gamma"}
    assert _post(app, "/v1/load_lora_adapter", load) == (200, "Success: LoRA adapter 'gamma' added successfully.")
    assert [c.text for c in (_complete(client, "gamma", p).choices[0] for p in PROMPTS)] == [
        expected[("gamma", p)] for p in PROMPTS]
    assert "gamma" in [m.id for m in client.models.list().data]
    gamma_stream = in_flight("gamma")
    assert _post(app, "/v1/unload_lora_adapter", unload) == (200, "Success: LoRA adapter 'gamma' removed successfully.")
    with pytest.raises(openai.NotFoundError):  # new requests: gone...
        _complete(client, "gamma", "Hi")
    assert gamma_stream.result(timeout=300) == LONG  # ...the one in flight finished with it
    assert base_stream.result(timeout=300) == LONG
    assert _post(app, "/v1/load_lora_adapter", load)[0] == 200  # loaded again: a new id, the same answers
    assert _complete(client, "gamma", PROMPTS[0]).choices[0].text == expected[("gamma", PROMPTS[0])]
    assert _post(app, "/v1/unload_lora_adapter", unload)[0] == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": "{model}"}, 400, "already been loaded"),
        ("/v1/load_lora_adapter", {"lora_name": "new"}, 400, "lora_path"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "'nope' cannot be found"),
    ],
)
def test_load_and_unload_errors(server: Server, path: str, body: dict[str, str], status: int, words: str) -> None:
    model = str(server.lora_paths["model"])
    got, answer = server.lora.http("POST", path, {k: v.format(model=model) for k, v in body.items()})
    assert got == status and words in answer["error"]["message"], answer


def test_outside_missing_and_not_an_adapter_get_one_400_naming_no_path(server: Server, tmp_path: Path) -> None:
    outside = shutil.copytree(server.lora_paths["gamma"], tmp_path / "gamma")  # a real adapter, not allowed
    root = server.lora_paths["root"]
    answers = [server.lora.http("POST", "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": str(path)})
               for path in (outside, root / "missing", server.lora_paths["model"])]  # fmt: skip
    assert [status for status, _ in answers] == [400] * 3
    messages = {body["error"]["message"] for _, body in answers}
    assert len(messages) == 1 and str(root) not in next(iter(messages)) and str(tmp_path) not in next(iter(messages))


def test_a_loaded_adapter_serves_the_bytes_checked_whatever_its_folder_does_after(
    server: Server, expected: dict[tuple[str, str], str], tmp_path: Path
) -> None:
    """Two copies of the rank-256 delta loaded under two names: one's weights replaced by gamma's, the other
    deleted, both before any request ran with them: their answers are delta's."""
    app, client, root = server.lora, server.lora.client(), server.lora_paths["root"]
    copies = {name: shutil.copytree(server.lora_paths["delta"], root / f"{name}-{tmp_path.name}")
              for name in ("changed", "deleted")}  # fmt: skip
    for name, folder in copies.items():
        assert _post(app, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})[0] == 200
    shutil.copy(server.lora_paths["gamma"] / "adapter_model.safetensors", copies["changed"])
    shutil.rmtree(copies["deleted"])
    try:
        for name in copies:
            assert _complete(client, name, PROMPTS[0]).choices[0].text == expected[("delta", PROMPTS[0])], name
        assert expected[("delta", PROMPTS[0])] != expected[("gamma", PROMPTS[0])]
    finally:
        for name in copies:
            _post(app, "/v1/unload_lora_adapter", {"lora_name": name})

