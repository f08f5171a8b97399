"""Speculative decoding through the HTTP server: one real local Ray cluster serves two cbserve apps.

- ``/ngram``: the bundled SmolLM2 on CPU with an n-gram ``speculative_config``. Greedy streamed chat and
  completion outputs on input-grounded prompts equal, token for token, the offline ``LLM``'s without
  speculation; drafts were proposed and accepted (the replica's /stats totals); beam search is refused with
  HTTP 400 naming why.
- ``/draft``: a tiny random Llama (word-level tokenizer) with ``speculative_config = {"method": "draft_model",
  "model": <the same folder>, ...}``. Greedy streamed completions equal the offline ``LLM``'s without
  speculation; the worker's draft proposed tokens and, being the target itself, every one was accepted (/stats
  totals); seeded sampled completions are reproducible."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import SharedRay

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
ENGINE = {"device": "cpu", "max_model_len": 384, "max_num_batched_tokens": 384}
TEXT = "Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly. Pack my box with five jugs."
CHAT = [{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}]
PROMPT = f"Rewrite the following text exactly.\nText: {TEXT}\nRewritten text: {TEXT[:30]}"
# the draft-model app
NAME = "tiny-draft"
VOCAB = 320
DRAFT_ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_batched_tokens": 32, "block_size": 4}
PROMPTS = [" ".join(f"w{(7 * i + j) % (VOCAB - 3) + 3}" for j in range(n)) for i, n in ((1, 9), (2, 23))]


def _tiny_model(folder: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="w1", eos_token="w2", unk_token="w0", pad_token="w0"
    ).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_model(tmp_path_factory.mktemp("draft_serving") / "tiny")


def _reference() -> dict[str, Any]:
    """Greedy outputs of the offline LLM without speculation."""
    from cbserve import LLM, SamplingParams

    llm = LLM(progress=False, **ENGINE)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=40)
        chat = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0]
        comp = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
        return {"chat": chat.text, "completion": comp.text, "chat_ids": chat.token_ids}
    finally:
        llm.shutdown()


def _draft_reference(model: Path) -> list[str]:
    """Greedy completions of the tiny model's offline LLM without speculation."""
    from cbserve import LLM, SamplingParams

    llm = LLM(str(model), progress=False, **DRAFT_ENGINE)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def served(shared_ray: SharedRay, model: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The base URL of the two apps, and the offline references (computed while the apps start)."""
    draft_spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    apps = {
        "ngram": {"device": "cpu", "worker_torch_threads": 1, "speculative_config": json.dumps(SPEC), **ENGINE},
        "draft": {"model": str(model), "served_model_name": NAME, "device": "cpu", "worker_torch_threads": 1,
                  "speculative_config": json.dumps(draft_spec), **DRAFT_ENGINE},
    }  # fmt: skip
    refs: dict[str, Any] = {}
    with shared_ray.apps(apps, meanwhile=lambda: refs.update(ngram=_reference(), draft=_draft_reference(model))) as url:
        yield url, refs


@pytest.fixture(scope="module")
def reference(served: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return served[1]["ngram"]


@pytest.fixture(scope="module")
def draft_reference(served: tuple[str, dict[str, Any]]) -> list[str]:
    return served[1]["draft"]


@pytest.fixture(scope="module")
def base_url(served: tuple[str, dict[str, Any]]) -> str:
    return served[0]


@pytest.fixture
def app_url(base_url: str) -> str:
    return base_url + "/ngram"


@pytest.fixture
def draft_url(base_url: str) -> str:
    return base_url + "/draft"


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _totals(url: str) -> dict[str, float]:
    """The replicas' speculative-decoding totals, summed, from /stats (every ``spec_*`` number in it)."""
    with urllib.request.urlopen(url + "/stats", timeout=30) as r:
        stats = json.loads(r.read())
    totals: dict[str, float] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.startswith("spec_") and isinstance(value, (int, float)):
                    totals[key] = totals.get(key, 0) + value
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(stats)
    return totals


def test_streamed_greedy_outputs_equal_those_without_speculation(app_url: str, reference: dict) -> None:
    client = _client(app_url)
    parts = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0.0,
                                                stream=True):  # fmt: skip
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == reference["chat"]
    assert len(parts) > 1  # streamed in pieces
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.0, stream=True)
        if c.choices
    )
    assert text == reference["completion"]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0.0)
    assert out.choices[0].message.content == reference["chat"]
    assert out.usage.completion_tokens == len(reference["chat_ids"])
    totals = _totals(app_url)
    assert totals.get("spec_num_draft_tokens", 0) > 0, totals
    assert 0 < totals.get("spec_num_accepted_tokens", 0) <= totals["spec_num_draft_tokens"], totals


def test_beam_search_is_refused_with_400(app_url: str) -> None:
    client = _client(app_url)
    with pytest.raises(openai.BadRequestError, match="beam search does not combine with speculative decoding"):
        client.completions.create(model=MODEL, prompt="hello", n=2, max_tokens=8, temperature=0.0,
                                  extra_body={"use_beam_search": True})  # fmt: skip


def test_streamed_greedy_completions_with_a_draft_model_equal_plain_decoding(
    draft_url: str, draft_reference: list[str]
) -> None:
    client = _client(draft_url)
    for prompt, want in zip(PROMPTS, draft_reference, strict=True):
        parts = [
            c.choices[0].text
            for c in client.completions.create(
                model=NAME, prompt=prompt, max_tokens=30, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
            )
            if c.choices and c.choices[0].text
        ]
        assert "".join(parts) == want
        assert len(parts) > 1  # streamed in pieces
    totals = _totals(draft_url)
    drafted = totals.get("spec_num_draft_tokens", 0)
    assert drafted > 20, totals
    assert totals.get("spec_num_accepted_tokens", 0) == drafted, totals  # the draft is the target


def test_seeded_sampling_with_a_draft_model_is_reproducible(draft_url: str) -> None:
    client = _client(draft_url)
    kw = {
        "model": NAME,
        "prompt": PROMPTS[0],
        "max_tokens": 20,
        "temperature": 0.8,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b and len(a.split()) == 20
