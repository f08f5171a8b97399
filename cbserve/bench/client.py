"""Streaming OpenAI-API client of ``cbserve bench`` (aiohttp): one request, timed per SSE chunk.

TTFT is the time from sending the request to the first chunk that carries text; ITL is the gap between
consecutive text chunks (a chunk may hold several tokens, so ITL is per chunk, as in vLLM's benchmark).
Token counts come from the final usage chunk (``stream_options.include_usage``) when the server sends one;
otherwise the output is counted as one token per text chunk and the prompt length is the dataset's estimate.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

Endpoint = Literal["completions", "chat"]


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without a trailing /v1)
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if self.endpoint == "chat" else "/completions")

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``start`` is on the benchmark's monotonic clock."""

    prompt_len: int
    output_len_requested: int
    success: bool = False
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    usage_reported: bool = False

    def to_dict(self, include_text: bool = False) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if include_text or k != "generated_text"}


def build_payload(cfg: ClientConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
    }
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM-style extension; pass --no-ignore-eos for servers without it
    body.update(cfg.extra_body)
    return body


def chunk_text(chunk: dict[str, Any], endpoint: Endpoint) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    prompt: str,
    prompt_len: int,
    max_tokens: int,
    clock: Any = time.perf_counter,
) -> RequestResult:
    """Send one streaming request and time it. Never raises for server or network errors: a failed
    request comes back with ``success=False`` and the error text."""
    res = RequestResult(prompt_len=prompt_len, output_len_requested=max_tokens)
    res.start = clock()
    last = res.start
    chunks = 0
    text: list[str] = []
    try:
        payload = build_payload(cfg, prompt, max_tokens)
        async with session.post(cfg.url, json=payload, headers=cfg.headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:500]}"
                return res
            async for data in _sse_data(r):
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return res
                now = clock()
                piece = chunk_text(chunk, cfg.endpoint)
                if piece:
                    if chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.latency = clock() - res.start
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: bad JSON in a chunk
        res.error = f"{type(e).__name__}: {e}"
        return res
    if chunks == 0:
        res.error = "no output tokens received"
        return res
    res.generated_text = "".join(text)
    if not res.usage_reported:
        res.prompt_tokens, res.output_tokens = prompt_len, chunks
    res.success = True
    return res


async def _sse_data(resp: aiohttp.ClientResponse):  # noqa: ANN202 - async generator of str
    """Yield the payload of each ``data:`` line of a server-sent-events stream."""
    buf = b""
    async for raw in resp.content.iter_any():
        buf += raw
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8")
    tail = buf.strip()
    if tail.startswith(b"data:"):
        yield tail[5:].strip().decode("utf-8")


async def fetch_models(session: aiohttp.ClientSession, cfg: ClientConfig) -> list[str]:
    """Model ids from ``GET /v1/models`` (to default --model to the server's first model)."""
    url = cfg.url.rsplit("/", 2 if cfg.endpoint == "chat" else 1)[0] + "/models"
    async with session.get(url, headers=cfg.headers) as r:
        if r.status != 200:
            raise RuntimeError(f"GET {url}: HTTP {r.status}: {(await r.text())[:300]}")
        body = await r.json()
    return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]
