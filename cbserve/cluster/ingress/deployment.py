"""The Ray Serve ingress: an OpenAI-compatible HTTP API (FastAPI) in front of the engine replicas.

A thin shell over the front end (``frontend/serving.py``): each route takes its typed body (FastAPI validates
it against the protocol model, so /openapi.json documents it) and hands it over. Routes: /v1/completions,
/v1/chat/completions (SSE when ``stream``), /v1/responses (and GET / DELETE /v1/responses/{id}:
``frontend/responses/api.py``), /v1/models, /v1/load_lora_adapter and /v1/unload_lora_adapter (with
``enable_lora``: ``frontend/lora_registry.py``, one set for every replica: ``lora_store.py``), /health, /tokenize,
/detokenize, /stats (engine replicas and router, for operators and tests), and an RL loop's controls (/pause,
/resume, /is_paused, /sleep, /wake_up, /is_sleeping, /reset_prefix_cache: ``rollout_api.py``). Auth, HTTP metrics
and OpenAI's error shape are the HTTP edge's (``http_edge.py``); the engine client stops in the app's lifespan.
Nothing here imports torch: the tokenizer and the model's numbers come from its files.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from ray import serve

from cbserve.cluster.ingress.engine_client import EngineClient
from cbserve.cluster.ingress.http_edge import ClosingStreamingResponse, HttpEdge, install_error_handlers
from cbserve.cluster.ingress.rollout_api import controls
from cbserve.cluster.ops.metrics import IngressMetrics
from cbserve.cluster.ops.node_tuning import node_tuning
from cbserve.cluster.ops.path_trace import PathTrace
from cbserve.cluster.stores.lora_store import SharedLoRAs
from cbserve.cluster.stores.response_store import SharedResponses
from cbserve.config import CBServeConfig
from cbserve.frontend.embeddings import EmbeddingRequest, EmbeddingResponse
from cbserve.frontend.lora_registry import (
    NOT_ENABLED,
    AdapterLimits,
    AdapterSet,
    LoadLoRAAdapterRequest,
    LoRARegistry,
    UnloadLoRAAdapterRequest,
)
from cbserve.frontend.model_files import model_folder, read_model_files
from cbserve.frontend.output import RequestState
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
from cbserve.frontend.responses.api import ResponsesAPI
from cbserve.frontend.responses.protocol import ResponseDeleted, ResponseObject, ResponsesRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.text.tokenizer import load_tokenizer
from cbserve.frontend.validation import ServedModel
from cbserve.worker.loading.model_info import read_model_info
from cbserve.worker.loading.pooling_config import read_pooling_config

logger = logging.getLogger(__name__)

STARTUP_WAIT_S = 900.0  # the longest a new ingress replica waits for its engines before it takes traffic
_SCHEMA_REF = "#/components/schemas/{model}"
_STREAM_CHUNKS = (ChatCompletionChunk,)  # documented as the SSE bodies of their routes
_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse} for s in (400, 401, 404, 429, 503)}


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The replica's engine client stops with the app (Serve runs the app's lifespan on the replica)."""
    yield
    ingress = getattr(app.state, "ingress", None)
    if ingress is not None:
        ingress.client.shutdown()


class OpenAIApp(FastAPI):
    """FastAPI whose /openapi.json also describes the stream chunks (SSE bodies) of the streaming routes."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is None:
            schema = super().openapi()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _STREAM_CHUNKS:
                body = model.model_json_schema(ref_template=_SCHEMA_REF)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
        return self.openapi_schema


def _streams(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """Route responses: OpenAI's error bodies, and for a 200 with ``stream`` the SSE chunks' schema."""
    sse = {"schema": {"$ref": _SCHEMA_REF.format(model=chunk.__name__)}}
    return {**_ERRORS, 200: {"content": {"text/event-stream": sse}}}


def _request_id(request: Request, body_id: str | None) -> str | None:
    """The request's id: the body's ``request_id``, else the X-Request-Id header. Serve's proxy puts one in
    every request that lacks it and sends it back in the response's X-Request-Id, so the response id
    (``cmpl-<id>``) and that header agree unless the body names its own id."""
    return body_id or request.headers.get("x-request-id")


def _response(result: Any) -> Response:
    """A route's result as the response: a stream as SSE (closed however it ends), a model as JSON."""
    if isinstance(result, Response):
        return result
    if isinstance(result, AsyncIterator):
        headers = {"Cache-Control": "no-cache"}
        return ClosingStreamingResponse(result, media_type="text/event-stream", headers=headers)
    if isinstance(result, BaseModel):
        result = result.model_dump()
    return JSONResponse(result)


api = OpenAIApp(title="cbserve", description="OpenAI-compatible LLM serving with continuous batching",
                lifespan=_lifespan, responses=_ERRORS)
api.add_middleware(HttpEdge)
install_error_handlers(api)


def _lora_registry(config: CBServeConfig) -> LoRARegistry:
    """This replica's adapters (the app's shared store fills it when LoRA is on: ``SharedLoRAs.start``); the load
    and unload routes only with ``allow_runtime_lora_updating``, for folders under ``lora_allowed_dirs``."""
    if not config.enable_lora:
        return LoRARegistry(config.model_name)
    dirs = tuple(config.lora_allowed_dirs or ()) if config.allow_runtime_lora_updating else None
    return LoRARegistry(config.model_name, AdapterLimits(read_model_info(config.model), config.max_lora_rank, dirs))


@serve.deployment(name="OpenAIIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(api)
class OpenAIIngress:
    async def __init__(self, config: dict[str, Any]) -> None:
        """Serve awaits this: the replica turns RUNNING (and, in a rolling update, takes traffic from the
        old version) only once its engine replicas loaded the model, or failed, or STARTUP_WAIT_S passed."""
        self._setup(config)
        if self.shared_loras is not None:
            registry = self.serving.loras  # the lora_modules' folders, checked again here (absolute paths)
            modules = {name: registry.check(name, path) for name, path in (self.config.lora_modules or {}).items()}
            await self.shared_loras.start(self.config.model, modules)
        self.client.start(on_tick=self._tick)
        await self.client.wait_started(STARTUP_WAIT_S)
        if self.shared_loras is not None:  # what changed while the engines loaded (no broadcast reaches a replica
            await self.shared_loras.pull()  # before it runs)
        # Behind the engine on this node's cores from now on, when the node tuning says so (cluster/ops/node_tuning.py);
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
        # the engines' workers fetch the app's LoRA adapters from its store, named after the Serve app
        self.config = self.config.model_copy(update={"app_name": app_name})
        requests: dict[str, RequestState] = {}  # the requests in flight: the front end's and the engine client's
        self.client = EngineClient(self.config, app_name, owner, requests)
        self.app_name = app_name
        self._ingress_handle: Any = None  # this deployment's handle, for broadcasts to every replica
        cfg = self.config
        vocab = files.vocab_size or len(tokenizer)
        pooling = read_pooling_config(folder) if cfg.runner == "pooling" else None
        served = ServedModel(
            cfg.model_name, cfg.max_model_len, cfg.max_n, vocab, cfg.ordering == "priority", cfg.tool_call_parser,
            cfg.reasoning_parser, cfg.disable_any_whitespace, runner=cfg.runner, pooling=pooling,
            retention_priority=cfg.kv_retention_cache_control_priority,
            retention_max_s=cfg.kv_retention_max_duration_s,
        )
        self.serving = OpenAIServing(served, tokenizer, self.client, files.eos_token_ids, _lora_registry(cfg),
                                     requests)
        # with LoRA on, the adapters are the app's, kept by its store (lora_store.py)
        self.shared_loras = SharedLoRAs(self.serving.loras, app_name, self._broadcast_loras) if cfg.enable_lora \
            else None
        # the app's store of responses, one for every replica (response_store_actor.py)
        self.responses = ResponsesAPI(self.serving, SharedResponses(app_name, cfg.responses_store_max_entries,
                                                                    cfg.responses_store_ttl_s))
        self.metrics = IngressMetrics(cfg.model_name)
        self.draining = False  # set by drain(): new requests are refused
        self.http_in_flight = 0  # requests the HTTP edge is answering
        self.path = PathTrace()
        api.state.ingress = self  # for the HTTP edge (auth, metrics) and the app's lifespan (shutdown)

    def _tick(self) -> None:
        """Every health period: the HTTP gauge again, and the router's decisions since the last tick."""
        self.metrics.refresh(self.http_in_flight)
        self.metrics.observe_routing(self.client.router.take_stats())
        if self.shared_loras is not None:
            self.shared_loras.tick()

    async def _broadcast_loras(self, adapters: AdapterSet) -> None:
        if self._ingress_handle is None:
            self._ingress_handle = serve.get_deployment_handle("OpenAIIngress", self.app_name)
        await self._ingress_handle.broadcast("sync_loras", adapters).results_async(timeout_s=30.0,
                                                                                    return_exceptions=True)

    async def path_trace(self, command: str) -> dict[str, list[str]]:
        """Record the files this replica's request loop runs ("start"), or stop and return them ("stop"): the request
        path's check (cluster/ops/path_trace.py)."""
        return self.path.command(command)

    async def sync_loras(self, adapters: AdapterSet | None = None) -> list[str]:
        """Serve ``adapters`` (a load or unload through another replica) when newer; the adapters served here."""
        if adapters is not None:
            self.serving.loras.apply(adapters)
        return [lora.lora_name for lora in self.serving.loras.adapters()]

    async def drain(self, dry_run: bool = False) -> dict[str, int]:
        """Graceful shutdown (``cbserve serve`` calls it on SIGTERM / Ctrl-C): stop admitting (new requests get
        503 with Retry-After, /health turns 503 so balancers stop sending), let the requests in flight finish
        for up to ``shutdown_timeout`` seconds, then end the rest with an error (aborted in their engines).
        ``dry_run``: nothing changes (``cbserve serve`` builds its handle's path to every replica with it while the
        app is idle, so the drain starts as the signal arrives)."""
        if dry_run:
            return {"in_flight": self.http_in_flight, "aborted": 0}
        self.draining = True
        at_start = self.http_in_flight
        logger.warning("draining: %d requests in flight, up to %gs", at_start, self.config.shutdown_timeout)
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self.http_in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.http_in_flight
        if left:
            self.client.fail_all("the server is shutting down; retry the request")
        return {"in_flight": at_start, "aborted": left}

    # ---- OpenAI routes ------------------------------------------------------------------------
    @api.post("/v1/completions", response_model=CompletionResponse, responses=_streams(CompletionResponse))
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return _response(await self.serving.completions(body, _request_id(request, body.request_id)))

    @api.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_streams(ChatCompletionChunk))
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return _response(await self.serving.chat(body, _request_id(request, body.request_id)))

    @api.post("/v1/responses", response_model=ResponseObject)
    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        return _response(await self.responses.create(body, _request_id(request, body.request_id)))

    @api.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def get_response(self, response_id: str) -> Response:
        return _response(await self.responses.retrieve(response_id))

    @api.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
    async def delete_response(self, response_id: str) -> Response:
        return _response(await self.responses.delete(response_id))

    @api.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        return _response(await self.serving.embeddings(body, _request_id(request, body.request_id)))

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> Response:
        return _response(self.serving.models())

    @api.get("/v1/models/{model:path}", response_model=ModelCard)
    async def model(self, model: str) -> Response:
        return _response(self.serving.model_card(model))

    @api.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        if self.shared_loras is None:
            return PlainTextResponse(self.serving.loras.load(body))  # a 404: LoRA is off
        return PlainTextResponse(await self.shared_loras.load(body))

    @api.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        if self.shared_loras is None:
            return PlainTextResponse(self.serving.loras.unload(body))  # a 404: LoRA is off
        return PlainTextResponse(await self.shared_loras.unload(body))

    async def load_lora_content(self, name: str, content: Any, load_inplace: bool = True) -> dict[str, Any]:
        """A trainer's adapter as bytes (``rl/adapters.py``; a Serve handle's call, no route), checked and served
        as ``name`` by every replica with a new id: requests in flight keep the adapter they started with."""
        if self.shared_loras is None:
            raise APIError(400, NOT_ENABLED)
        lora = await self.shared_loras.load_content(name, content, load_inplace)
        return {"lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id, "digest": lora.digest}

    # ---- an RL loop's controls, on every engine replica of the app (rollout_api.py); also Serve handle calls ----
    async def pause(self, mode: str = "keep") -> dict[str, Any]:
        return await controls(self.app_name, "pause", mode)

    async def resume(self) -> dict[str, Any]:
        return await controls(self.app_name, "resume")

    async def is_paused(self) -> dict[str, Any]:
        return await controls(self.app_name, "is_paused")

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        return await controls(self.app_name, "sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return await controls(self.app_name, "wake_up", tags)

    async def is_sleeping(self) -> dict[str, Any]:
        return await controls(self.app_name, "is_sleeping")

    async def reset_prefix_cache(self) -> dict[str, Any]:
        return await controls(self.app_name, "reset_prefix_cache")

    @api.post("/pause")
    async def pause_route(self, mode: str = "keep") -> Response:
        return _response(await self.pause(mode))

    @api.post("/resume")
    async def resume_route(self) -> Response:
        return _response(await self.resume())

    @api.get("/is_paused")
    async def is_paused_route(self) -> Response:
        return _response(await self.is_paused())

    @api.post("/sleep")
    async def sleep_route(self, level: int = 1) -> Response:
        return _response(await self.sleep(level))

    @api.post("/wake_up")
    async def wake_up_route(self, tags: list[str] | None = Query(None)) -> Response:  # noqa: B008 (FastAPI's way)
        return _response(await self.wake_up(tags))

    @api.get("/is_sleeping")
    async def is_sleeping_route(self) -> Response:
        return _response(await self.is_sleeping())

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache_route(self) -> Response:
        return _response(await self.reset_prefix_cache())

    # ---- operations ---------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if not self.client.ready:  # the replicas' states come on their channels
            states = ", ".join(f"{h.get('replica')}: {h.get('state')}" for h in self.client.health)
            raise APIError(503, f"engine replicas not ready ({states})", "service_unavailable")
        return _response({"status": "ok", "replicas": self.client.health})

    @api.get("/stats")
    async def stats(self) -> Response:
        return _response({"model": self.config.model_name, "replicas": await self.client.stats()})

    @api.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(self, body: TokenizeRequest) -> Response:
        return _response(self.serving.tokenize(body))

    @api.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(self, body: DetokenizeRequest) -> Response:
        return _response(self.serving.detokenize(body))
