"""The Ray Serve ingress: an OpenAI-compatible HTTP API (FastAPI) in front of the engine replicas.

A thin shell over the front end (``frontend/serving.py``): each route parses its body into the protocol
model and hands it over. Routes: /v1/completions, /v1/chat/completions (SSE when ``stream``), /v1/models,
/health, /tokenize, /detokenize, and /stats (engine replicas and router, for operators and tests). Errors use
OpenAI's body shape. With ``api_key`` set, every route but /health needs ``Authorization: Bearer <key>``
(401). Nothing here imports torch: the tokenizer and the model's numbers come from its files.
"""

import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from starlette.types import Receive, Scope, Send

from cbserve.cluster.config import CBServeConfig
from cbserve.cluster.engine_client import EngineClient
from cbserve.cluster.metrics import IngressMetrics
from cbserve.cluster.node_tuning import node_tuning
from cbserve.frontend.model_files import model_folder, read_model_files
from cbserve.frontend.protocol import (
    APIError,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.tokenizer import load_tokenizer
from cbserve.frontend.validation import ServedModel, parse_body

logger = logging.getLogger(__name__)

STARTUP_WAIT_S = 900.0  # the longest a new ingress replica waits for its engines before it takes traffic
_SCHEMA_REF = "#/components/schemas/{model}"
# Parsed by the routes themselves (to answer OpenAI-shaped 400s), so FastAPI does not see them: documented here.
_DOCUMENTED_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, ChatCompletionChunk)
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 429, 503)}


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body however the response ends. Starlette's leaves a body cut short
    (the client went away: ``send`` raised, or Serve cancelled the handler) suspended at its last ``yield``,
    to be closed whenever the garbage collector gets to it; only then would the request's generators run
    their ``finally`` blocks, the engine's abort among them, and the request ran on to its end meanwhile."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class OpenAIApp(FastAPI):
    """FastAPI whose /openapi.json also describes the request bodies and stream chunks of the routes."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _DOCUMENTED_MODELS:
                body = model.model_json_schema(ref_template=_SCHEMA_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return self.openapi_schema


def _doc(body: type[BaseModel] | None = None, stream: type[BaseModel] | None = None) -> dict[str, Any]:
    """Route keywords documenting a request body parsed by hand and, for SSE, the stream's chunks."""
    responses: dict[int | str, dict[str, Any]] = dict(_ERRORS)
    if stream is not None:
        sse = {"schema": {"$ref": _SCHEMA_REF.format(model=stream.__name__)}}
        responses[200] = {"content": {"text/event-stream": sse}}
    if body is None:
        return {"responses": responses}
    content = {"application/json": {"schema": {"$ref": _SCHEMA_REF.format(model=body.__name__)}}}
    return {"responses": responses, "openapi_extra": {"requestBody": {"required": True, "content": content}}}


def _request_id(request: Request, body_id: str | None) -> str | None:
    """The request's id: the body's ``request_id``, else the X-Request-Id header. Serve's proxy puts one in
    every request that lacks it and sends it back in the response's X-Request-Id, so the response id
    (``cmpl-<id>``) and that header agree unless the body names its own id."""
    return body_id or request.headers.get("x-request-id")


api = OpenAIApp(title="cbserve", description="OpenAI-compatible LLM serving with continuous batching")

Handler = Callable[[Request], Awaitable[Any]]


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(api)
class OpenAIIngress:
    async def __init__(self, config: dict[str, Any]) -> None:
        """Serve awaits this: the replica turns RUNNING (and, in a rolling update, takes traffic from the
        old version) only once its engine replicas loaded the model, or failed, or STARTUP_WAIT_S passed."""
        self._setup(config)
        self.client.start(on_tick=self.metrics.refresh)
        await self.client.wait_started(STARTUP_WAIT_S)
        # Behind the engine on this node's cores from now on, when the node tuning says so (cluster/node_tuning.py);
        # its start-up work (a GGUF's conversion, the tokenizer) is done, and under SCHED_BATCH it took seconds longer.
        node_tuning(self.config.node_tuning).edge_started()

    def _setup(self, config: dict[str, Any]) -> None:
        folder = model_folder(CBServeConfig.model_validate(config).model)  # a GGUF: converted, in a child
        files = read_model_files(folder)
        model_max = files.max_position_embeddings or config["max_model_len"]
        # The engines and this edge agree on the context length: the configured one, capped by the model's.
        self.config = CBServeConfig.model_validate(
            dict(config, max_model_len=min(config["max_model_len"], model_max))
        )
        tokenizer = load_tokenizer(folder)
        try:
            ctx = serve.get_replica_context()
            app_name, owner = ctx.app_name, ctx.replica_id.unique_id
        except Exception:  # outside Serve (unit tests)
            app_name, owner = self.config.app_name, uuid.uuid4().hex[:8]
        self.client = EngineClient(self.config, app_name, owner)
        cfg = self.config
        vocab = files.vocab_size or len(tokenizer)
        served = ServedModel(
            cfg.model_name, cfg.max_model_len, cfg.max_n, vocab, cfg.ordering == "priority", cfg.tool_call_parser,
            cfg.reasoning_parser, cfg.disable_any_whitespace,
        )
        self.serving = OpenAIServing(served, tokenizer, self.client, files.eos_token_ids)
        self.metrics = IngressMetrics(cfg.model_name)

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.shutdown()

    # ---- plumbing -----------------------------------------------------------------------------
    async def _handle(self, route: str, request: Request, fn: Handler, auth: bool = True) -> Response:
        """Auth, error mapping and metrics around one route. A streamed response counts as in flight, and
        its duration runs, until its last byte is sent (or the client goes away)."""
        start = time.perf_counter()
        self.metrics.in_flight(1)
        try:
            if auth:
                self._check_api_key(request)
            result = await fn(request)
        except APIError as e:
            result = JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # a bug: report it as such
            logger.exception("internal error on %s", route)
            err = APIError(500, f"internal server error: {type(e).__name__}: {e}", "internal_error")
            result = JSONResponse(err.body(), status_code=500)
        except BaseException:  # cancelled: the client went away before an answer
            self.metrics.in_flight(-1)
            raise
        if isinstance(result, AsyncIterator):
            return self._to_response(self._accounted(route, start, result))
        self.metrics.in_flight(-1)
        response = self._to_response(result)
        self.metrics.observe_http(route, response.status_code, time.perf_counter() - start)
        return response

    async def _accounted(self, route: str, start: float, body: AsyncIterator[Any]) -> AsyncIterator[Any]:
        try:
            async with contextlib.aclosing(body):  # type: ignore[type-var]
                async for chunk in body:
                    yield chunk
        finally:
            self.metrics.in_flight(-1)
            self.metrics.observe_http(route, 200, time.perf_counter() - start)

    @staticmethod
    def _to_response(result: Any) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, AsyncIterator):
            headers = {"Cache-Control": "no-cache"}
            return ClosingStreamingResponse(result, media_type="text/event-stream", headers=headers)
        if isinstance(result, BaseModel):
            result = result.model_dump()
        return JSONResponse(result)

    def _check_api_key(self, request: Request) -> None:
        key = self.config.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            msg = "invalid or missing API key (Authorization: Bearer <key>)"
            raise APIError(401, msg, "authentication_error")

    # ---- OpenAI routes ------------------------------------------------------------------------
    @api.post("/v1/completions", response_model=CompletionResponse, **_doc(CompletionRequest, CompletionResponse))
    async def completions(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            body = parse_body(CompletionRequest, await r.body())
            return await self.serving.completions(body, _request_id(r, body.request_id))

        return await self._handle("/v1/completions", request, run)

    @api.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse,
        **_doc(ChatCompletionRequest, ChatCompletionChunk),
    )
    async def chat_completions(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            body = parse_body(ChatCompletionRequest, await r.body())
            return await self.serving.chat(body, _request_id(r, body.request_id))

        return await self._handle("/v1/chat/completions", request, run)

    @api.get("/v1/models", response_model=ModelList, **_doc())
    async def models(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return self.serving.models()

        return await self._handle("/v1/models", request, run)

    @api.get("/v1/models/{model:path}", response_model=ModelCard, **_doc())
    async def model(self, model: str, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return self.serving.model_card(model)

        return await self._handle("/v1/models/{model}", request, run)

    # ---- operations ---------------------------------------------------------------------------
    @api.get("/health", **_doc())
    async def health(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            await self.client.refresh_health()
            if not self.client.ready:
                states = ", ".join(f"{h.get('replica')}: {h.get('state')}" for h in self.client.health)
                raise APIError(503, f"engine replicas not ready ({states})", "service_unavailable")
            return {"status": "ok", "replicas": self.client.health}

        return await self._handle("/health", request, run, auth=False)

    @api.get("/stats", **_doc())
    async def stats(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return {"model": self.config.model_name, "replicas": await self.client.stats()}

        return await self._handle("/stats", request, run)

    @api.post("/tokenize", response_model=TokenizeResponse, **_doc(TokenizeRequest))
    async def tokenize(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return self.serving.tokenize(parse_body(TokenizeRequest, await r.body()))

        return await self._handle("/tokenize", request, run)

    @api.post("/detokenize", response_model=DetokenizeResponse, **_doc(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return self.serving.detokenize(parse_body(DetokenizeRequest, await r.body()))

        return await self._handle("/detokenize", request, run)
