"""The Ray Serve ingress: an OpenAI-compatible HTTP API (FastAPI) in front of the engine replicas.

Routes: /v1/completions, /v1/chat/completions (SSE when ``stream``), /v1/models, /health, /tokenize,
/detokenize, and /stats (engine replicas and router, for operators and tests). Errors use OpenAI's body
shape. With ``api_key`` set, every route but /health needs ``Authorization: Bearer <key>`` (401).
"""


import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from cbserve.cluster.config import CBServeConfig
from cbserve.cluster.engine_client import EngineClient
from cbserve.cluster.metrics import IngressMetrics
from cbserve.cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from cbserve.cluster.openai_serving import OpenAIServing
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

logger = logging.getLogger(__name__)

STARTUP_WAIT_S = 900.0  # the longest a new ingress replica waits for its engines before it takes traffic

api = FastAPI(title="cbserve", description="OpenAI-compatible LLM serving with continuous batching")

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

    def _setup(self, config: dict[str, Any]) -> None:
        from cbserve.worker.model_loader import eos_token_ids, load_hf_config, resolve_model
        from cbserve.worker.tokenizer import load_tokenizer

        folder = resolve_model(CBServeConfig.model_validate(config).model).folder
        hf_config = load_hf_config(folder)
        model_max = int(getattr(hf_config, "max_position_embeddings", 0) or config["max_model_len"])
        # The engines and this edge agree on the context length: the configured one, capped by the model's.
        self.config = CBServeConfig.model_validate(
            dict(config, max_model_len=min(config["max_model_len"], model_max))
        )
        self.tokenizer = load_tokenizer(folder)
        eos = sorted(eos_token_ids(folder, hf_config))
        if self.tokenizer.eos_token_id is not None:  # as the offline LLM: the tokenizer's EOS first
            eos = [self.tokenizer.eos_token_id] + [t for t in eos if t != self.tokenizer.eos_token_id]
        try:
            ctx = serve.get_replica_context()
            app_name, owner = ctx.app_name, ctx.replica_id.unique_id
        except Exception:  # outside Serve (unit tests)
            app_name, owner = self.config.app_name, uuid.uuid4().hex[:8]
        self.client = EngineClient(self.config, app_name, owner)
        vocab = int(getattr(hf_config, "vocab_size", 0) or len(self.tokenizer))
        self.serving = OpenAIServing(self.config, self.tokenizer, self.client, eos, vocab)
        self.metrics = IngressMetrics(self.config.model_name)

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
            return StreamingResponse(result, media_type="text/event-stream", headers=headers)
        if hasattr(result, "model_dump"):
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
    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return await self.serving.completions(self.serving.parse(CompletionRequest, await r.body()))

        return await self._handle("/v1/completions", request, run)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return await self.serving.chat(self.serving.parse(ChatCompletionRequest, await r.body()))

        return await self._handle("/v1/chat/completions", request, run)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return ModelList(data=[self._card()])

        return await self._handle("/v1/models", request, run)

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> Response:
        async def run(r: Request) -> Any:
            self.serving.check_model(model)
            return self._card()

        return await self._handle("/v1/models/{model}", request, run)

    def _card(self) -> ModelCard:
        return ModelCard(id=self.config.model_name, max_model_len=self.config.max_model_len)

    # ---- operations ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            await self.client.refresh_health()
            if not self.client.ready:
                states = ", ".join(f"{h.get('replica')}: {h.get('state')}" for h in self.client.health)
                raise APIError(503, f"engine replicas not ready ({states})", "service_unavailable")
            return {"status": "ok", "replicas": self.client.health}

        return await self._handle("/health", request, run, auth=False)

    @api.get("/stats")
    async def stats(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            return {"model": self.config.model_name, "replicas": await self.client.stats()}

        return await self._handle("/stats", request, run)

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            req = self.serving.parse(TokenizeRequest, await r.body())
            self.serving.check_model(req.model)
            if req.messages is not None:
                tokens = self.serving.chat_prompt(req.messages, req.add_generation_prompt)
            elif req.prompt is not None:
                enc = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)
                tokens = list(enc["input_ids"])
            else:
                raise APIError(400, "give 'prompt' or 'messages'", param="prompt")
            return {"tokens": tokens, "count": len(tokens), "max_model_len": self.config.max_model_len}

        return await self._handle("/tokenize", request, run)

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        async def run(r: Request) -> Any:
            req = self.serving.parse(DetokenizeRequest, await r.body())
            self.serving.check_model(req.model)
            vocab = len(self.tokenizer)
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
            return {"prompt": self.tokenizer.decode(req.tokens)}

        return await self._handle("/detokenize", request, run)
