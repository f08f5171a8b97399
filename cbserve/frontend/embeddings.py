"""Embeddings (a model served with ``runner: pooling``): ``/v1/embeddings`` behind ``OpenAIServing.embeddings``,
and the outputs of the offline ``LLM.embed``.

Each input is one engine request: its prompt is computed (in chunks when it is long, batched with the others
by the one scheduler), pooled by the worker (``worker/runner/pooler.py``) and finished with its vector
(``RequestOutput.embedding``). The edge checks the inputs (text, texts, token ids or lists of them; longer than
``max_model_len`` is a 400 unless ``truncate_prompt_tokens`` cuts them), cuts Matryoshka models' vectors to
``dimensions`` (then renormalizes them when the model normalizes) and writes them as floats or base64
(little-endian float32, as OpenAI).
"""

from __future__ import annotations

import array
import asyncio
import base64
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cbserve.frontend.protocol import APIError, new_id, now
from cbserve.scheduler.errors import RequestRejectedError
from cbserve.scheduler.requests.limits import check_pooling_prompt
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.loading.pooling_config import PoolingConfig


# ---- the API's models --------------------------------------------------------------------------------
class EmbeddingRequest(BaseModel):
    """OpenAI's ``/v1/embeddings`` body, with vLLM's extras. ``input``: a text, texts, token ids or lists of them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32, as OpenAI
    dimensions: int | None = None  # Matryoshka models only: the first k dimensions, renormalized
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k input tokens (-1: max_model_len)
    add_special_tokens: bool = True
    priority: int = 0  # lower runs first (needs the "priority" ordering)
    request_id: str | None = None  # echoed in the response id and the X-Request-Id header


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def pooling_params() -> SamplingParams:
    """What a pooling engine request carries: nothing is sampled, its one "output token" is never computed."""
    return SamplingParams(max_tokens=1)


@dataclass
class EmbeddingOutput:
    """vLLM's shape: ``output.outputs.embedding``."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One input's result of ``LLM.embed``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt: str | None = None
    finished: bool = True


def runner_error(runner: str, endpoint: str) -> APIError:
    """The 400 for an endpoint the server's runner does not serve."""
    if runner == "pooling":
        why = "runner 'pooling' (embeddings only: /v1/embeddings)"
    else:
        why = f"runner '{runner}'; start the server with --runner pooling to serve embeddings"
    msg = f"{endpoint} is not available: this model is served with {why}"
    return APIError(400, msg, param="model")


def cut_dimensions(vector: list[float], dims: int | None, normalize: bool) -> list[float]:
    """A Matryoshka vector's first ``dims`` values, renormalized when the model normalizes."""
    if dims is None:
        return vector
    if dims > len(vector):
        raise APIError(400, f"dimensions must be <= {len(vector)} (the model's)", param="dimensions")
    part = vector[:dims]
    norm = math.sqrt(math.fsum(x * x for x in part)) if normalize else 0.0
    return [x / norm for x in part] if norm > 0.0 else part


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """Floats, or base64 of the little-endian float32 values (OpenAI's ``encoding_format: base64``)."""
    if encoding_format == "float":
        return vector
    values = array.array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


class Embedder:
    """``/v1/embeddings``: ``validator`` is the serving's ``RequestValidator``, ``engine`` its engine, ``processor``
    its output processor (every request in flight is in its ``requests``)."""

    def __init__(self, validator: Any, engine: Any, pooling: PoolingConfig | None, processor: Any) -> None:
        self.validator = validator
        self.served = validator.served
        self.engine = engine
        self.pooling = pooling or PoolingConfig()
        self.processor = processor

    async def __call__(self, req: EmbeddingRequest, request_id: str | None = None) -> EmbeddingResponse:
        v = self.validator
        v.check_request(req)
        dims = self._check_dimensions(req.dimensions)
        prompts = self.prompts(req)
        rid = new_id("embd") if not (request_id or req.request_id) else f"embd-{request_id or req.request_id}"
        vectors = await self._embed_all(rid, prompts, req.priority)
        data = [
            EmbeddingData(index=i, embedding=encode_vector(cut_dimensions(vec, dims, self.pooling.normalize),
                                                           req.encoding_format))
            for i, vec in enumerate(vectors)
        ]
        num = sum(len(p) for p in prompts)
        return EmbeddingResponse(id=rid, model=self.served.name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num, total_tokens=num))

    def prompts(self, req: EmbeddingRequest) -> list[list[int]]:
        """The inputs as token ids, truncated per ``truncate_prompt_tokens`` and checked against max_model_len."""
        inp: Any = req.input
        if isinstance(inp, str) or (inp and all(isinstance(t, int) for t in inp)):
            inp = [inp]
        if not inp:
            raise APIError(400, "input is empty", param="input")
        v = self.validator
        prompts = []
        for item in inp:
            try:
                ids = v.encode(item, req.add_special_tokens) if isinstance(item, str) else v.checked_ids(item)
                ids = v.truncated(ids, req.truncate_prompt_tokens)
                check_pooling_prompt(len(ids), self.served.max_model_len)
            except RequestRejectedError as e:
                raise APIError(400, str(e), param="input") from e
            except APIError as e:
                e.param = "input" if e.param == "prompt" else e.param
                raise
            prompts.append(ids)
        return prompts

    def _check_dimensions(self, dims: int | None) -> int | None:
        if dims is None:
            return None
        p = self.pooling
        if not p.matryoshka:
            raise APIError(400, f"model {self.served.name!r} does not support Matryoshka representation: changing "
                                "its output dimensions is refused", param="dimensions")
        if dims < 1:
            raise APIError(400, "dimensions must be >= 1", param="dimensions")
        if p.matryoshka_dimensions is not None and dims not in p.matryoshka_dimensions:
            raise APIError(400, f"model {self.served.name!r} only supports dimensions "
                                f"{list(p.matryoshka_dimensions)}", param="dimensions")
        return dims

    async def _embed_all(self, rid: str, prompts: Sequence[list[int]], priority: int) -> list[list[float]]:
        """All inputs at once (the engine batches them); the first error cancels the others (aborting them)."""
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        tasks = [asyncio.ensure_future(self._embed_one(r, p, priority)) for r, p in zip(ids, prompts, strict=True)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _embed_one(self, req_id: str, prompt: list[int], priority: int) -> list[float]:
        self.processor.add_request(req_id, prompt, pooling_params(), priority=priority)
        try:
            outputs = await self.engine.add(self.processor.requests[req_id])
        except BaseException:
            self.processor.pop(req_id)
            raise
        try:
            async for batch in outputs:
                for out in batch:
                    self.processor.process(out)
                    if out.finished and out.embedding is not None:
                        return out.embedding
                    if out.finished:
                        raise APIError(500, f"request {req_id} finished ({out.finish_reason}) without an embedding",
                                       "internal_error")
            raise APIError(500, f"request {req_id}: the engine's stream ended without an embedding", "internal_error")
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
            self.processor.pop(req_id)
