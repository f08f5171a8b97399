"""``cbserve serve --model sim``: the simulated engine (an H100 serving Llama-3-8B, no weights) behind the
whole stack answers the official OpenAI client, streamed and not, with text the bundled tokenizer decodes."""

from __future__ import annotations

import pytest

from cbserve.bench.deploy import local_deployment

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
openai = pytest.importorskip("openai")


def test_cbserve_serve_model_sim_answers_chat_completions() -> None:
    args = {"model": "sim", "num_replicas": 2, "max_model_len": 4096}
    with local_deployment(args, timeout_s=240) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["sim"]
        messages = [{"role": "user", "content": "Hello!"}]
        reply = client.chat.completions.create(model="sim", messages=messages, max_tokens=12)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
        assert reply.choices[0].message.content
        stream = client.chat.completions.create(model="sim", messages=messages, max_tokens=16, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
