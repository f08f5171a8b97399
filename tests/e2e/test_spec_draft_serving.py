"""Speculative decoding with a draft model through the HTTP server: a real local Ray cluster serves a tiny random
Llama (word-level tokenizer) with ``speculative_config = {"method": "draft_model", "model": <the same
folder>, ...}``. Greedy streamed completions equal, token for token, the offline ``LLM``'s without
speculation; the worker's draft proposed tokens and, being the target itself, every one was accepted
(/stats totals); seeded sampled completions are reproducible."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_lib import local_serve_app
from test_spec_serving import _totals

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "tiny-draft"
VOCAB = 320
ENGINE = {"max_model_len": 256, "max_num_batched_tokens": 32, "block_size": 4}
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


@pytest.fixture(scope="module")
def reference(model: Path) -> list[str]:
    """Greedy completions of the offline LLM without speculation (before Ray starts)."""
    from cbserve import LLM, SamplingParams

    llm = LLM(str(model), progress=False, **ENGINE)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def app_url(model: Path, reference: list[str]) -> Iterator[str]:
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    args = {"model": str(model), "served_model_name": NAME, "device": "cpu", "worker_torch_threads": 1,
            "speculative_config": json.dumps(spec), **ENGINE}
    with local_serve_app(args, "cbserve-spec-draft") as url:
        yield url


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_streamed_greedy_completions_with_a_draft_model_equal_plain_decoding(
    app_url: str, reference: list[str]
) -> None:
    client = _client(app_url)
    for prompt, want in zip(PROMPTS, reference, strict=True):
        parts = [
            c.choices[0].text
            for c in client.completions.create(
                model=NAME, prompt=prompt, max_tokens=30, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
            )
            if c.choices and c.choices[0].text
        ]
        assert "".join(parts) == want
        assert len(parts) > 1  # streamed in pieces
    totals = _totals(app_url)
    drafted = totals.get("spec_num_draft_tokens", 0)
    assert drafted > 20, totals
    assert totals.get("spec_num_accepted_tokens", 0) == drafted, totals  # the draft is the target


def test_seeded_sampling_with_a_draft_model_is_reproducible(app_url: str) -> None:
    client = _client(app_url)
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
