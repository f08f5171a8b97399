"""The ingress documents the real request and response bodies in /openapi.json, and what users import stays
light: ``from cbserve import LLM`` pulls in neither ray nor triton nor torch, the ingress module no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

LEAK_CHECK = "import sys; {stmt}; print(json.dumps(sorted(m for m in {mods} if m in sys.modules)))"


def _modules_after(stmt: str, mods: tuple[str, ...]) -> list[str]:
    code = "import json; " + LEAK_CHECK.format(stmt=stmt, mods=mods)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_llm_imports_neither_ray_triton_nor_torch() -> None:
    assert _modules_after("from cbserve import LLM, SamplingParams", ("ray", "triton", "torch")) == []
    assert _modules_after("import cbserve.frontend.llm, cbserve.frontend.serving", ("ray", "triton", "torch")) == []


def test_importing_the_ingress_imports_no_torch() -> None:
    pytest.importorskip("ray")
    assert _modules_after("import cbserve.cluster.ingress.deployment", ("triton", "torch")) == []


def _resolve(doc: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/components/schemas/"), ref
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_openapi_documents_request_and_response_bodies() -> None:
    pytest.importorskip("ray")
    from cbserve.cluster.ingress.deployment import api

    doc = api.openapi()
    for ref in _refs(doc):  # every reference resolves
        _resolve(doc, ref)
    paths = doc["paths"]
    cases = {
        "/v1/completions": ("prompt", "CompletionResponse"),
        "/v1/chat/completions": ("messages", "ChatCompletionChunk"),
    }
    for path, (field, chunk) in cases.items():
        op = paths[path]["post"]
        body = _resolve(doc, op["requestBody"]["content"]["application/json"]["schema"]["$ref"])
        assert field in body["properties"] and field in body["required"]
        assert {"n", "temperature", "stop", "stream", "max_tokens"} <= set(body["properties"])
        # issue 18's fields, honoured or refused, are all documented
        assert {"logit_bias", "prompt_logprobs", "bad_words", "allowed_token_ids", "priority", "cache_salt",
                "request_id", "response_format", "structured_outputs"} <= set(body["properties"])
        ok = op["responses"]["200"]["content"]
        assert ok["text/event-stream"]["schema"]["$ref"].endswith("/" + chunk)
        assert "choices" in _resolve(doc, ok["application/json"]["schema"]["$ref"])["properties"]
        error = _resolve(doc, op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"])
        assert error["properties"]["error"]["$ref"].endswith("/ErrorInfo")
    assert "data" in _resolve(doc, paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
                              ["schema"]["$ref"])["properties"]
