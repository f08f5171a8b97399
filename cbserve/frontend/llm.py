"""Offline, in-process generation: ``from cbserve import LLM, SamplingParams``.

``LLM(model=None, **fields).generate(prompts, params)`` runs an EngineCore over a LocalExecutor in this process
(no Ray). ``fields`` are ``CBServeConfig``'s (config/serve_config.py), with its defaults; the engine and worker
configurations come from it as served. Prompts may be text, chat messages (a list of role/content dicts,
rendered with the model's chat template) or token id lists, alone or in a list; outputs come back in input order.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from cbserve.config import CBServeConfig, check_kv_capacity, servable_config
from cbserve.config.offline import offline_config
from cbserve.frontend.embeddings import EmbeddingOutput, EmbeddingRequestOutput, pooling_params
from cbserve.frontend.lora_contents import LocalAdapters
from cbserve.frontend.model_files import read_model_files
from cbserve.frontend.output import CompletionOutput, GenerateOutput, OutputProcessor
from cbserve.frontend.text.tokenizer import apply_chat_template, load_tokenizer
from cbserve.scheduler import EngineCore, tune_gc_for_serving
from cbserve.scheduler.requests.kv_transfer import KVTransferParams
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import EngineRequest
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.loading.model_info import ModelInfo

logger = logging.getLogger(__name__)

__all__ = ["LLM", "CompletionOutput", "EmbeddingRequestOutput", "GenerateOutput", "SamplingParams"]

Messages = list[dict[str, Any]]
PromptInput = str | list[int] | Messages


class LLM:
    """An in-process engine. ``fields``: ``CBServeConfig``'s fields, same names and defaults (``dtype``,
    ``max_model_len``, ``max_num_batched_tokens``, ``kv_cache_memory_bytes``, ``num_kv_blocks``, ``policy``,
    ``async_scheduling``, ``runner`` ("pooling": ``embed`` instead of ``generate``), ``enable_lora`` and
    ``max_loras`` (adapters per ``generate`` call's ``lora_request``), ``speculative_config``...); a field set to
    None keeps its default. The served-only fields (HTTP, Ray, routing: ``config/offline.py``) and unknown names
    raise TypeError, bad values ValueError. ``progress``: a progress bar while the model loads. The
    validated configuration is ``llm.config``."""

    def __init__(self, model: str | None = None, *, progress: bool = True, **fields: Any) -> None:
        from cbserve.worker.runner.executor import LocalExecutor

        config = servable_config(offline_config(model, fields))  # the KV budget is checked once it is allocated
        self.model_config = config.worker_model_config()
        self.executor = LocalExecutor(self.model_config, config.num_kv_blocks, progress)
        runner = self.executor.runner
        try:
            if runner.max_model_len < config.max_model_len:  # the model's own limit, where its header has none
                config = config.model_copy(update={"max_model_len": runner.max_model_len})
            check_kv_capacity(config, self.executor.num_blocks, config.resolved_device)
        except BaseException:
            self.executor.shutdown()
            raise
        self.config: CBServeConfig = config
        self.runner = config.runner
        self.tokenizer = load_tokenizer(runner.model_folder)
        self.max_model_len = config.max_model_len
        self.eos_token_ids = list(read_model_files(runner.model_folder).eos_token_ids)
        self._model_info = ModelInfo.from_hf_config(runner.hf_config.to_dict())
        # adapters are checked whole once and run from the bytes checked (kept here), whatever their files do later
        self._adapters = LocalAdapters(self._model_info, config.max_lora_rank, self.model_config.lora_cache_size)
        manager = getattr(runner, "lora", None)
        if manager is not None:
            manager.source = self._adapters
        tiers = runner.kv_tiers  # the KV tiers' sizes come from the worker that holds them
        self.engine_config = config.engine_config(self.executor.num_blocks, tiers.config if tiers else None)
        self.engine = EngineCore(self.engine_config, self.executor)
        self.processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self._finish_on_stop)
        self._ids = itertools.count()
        tune_gc_for_serving()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- public API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> list[GenerateOutput]:
        """Generate for one prompt or a list of prompts; returns one GenerateOutput per prompt, in order.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base model); the LLM
        must be built with ``enable_lora=True``. ``kv_transfer_params``: vLLM's prefill/decode handshake for every
        prompt (scheduler/requests/kv_transfer.py; an LLM built with ``disaggregation``); a prefill's answer is the
        output's ``kv_transfer_params``."""
        self._check_runner("generate", "generate")
        plist = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(plist))
        loras = self._loras(lora_request, len(plist))
        encoded = [self._encode(p) for p in plist]
        return self._run(encoded, params, use_tqdm, loras, KVTransferParams.from_json(kv_transfer_params))

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerateOutput]:
        """Generate replies to one conversation or a list of conversations (chat template applied)."""
        self._check_runner("generate", "chat")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore
        loras = self._loras(lora_request, len(convs))
        encoded = []
        for conv in convs:
            ids = apply_chat_template(self.tokenizer, conv, add_generation_prompt=add_generation_prompt)
            encoded.append((self.tokenizer.decode(ids), ids))
        return self._run(encoded, _as_params_list(sampling_params, len(convs)), use_tqdm, loras)

    def embed(
        self, prompts: str | list[int] | Sequence[str | list[int]], truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed one prompt or a list of prompts (text or token ids) with a ``runner="pooling"`` model; one output
        per prompt, in order (``out.outputs.embedding``). ``truncate_prompt_tokens``: keep the last k tokens."""
        self._check_runner("pooling", "embed")
        encoded = [self._encode(p) for p in _as_prompt_list(prompts)]
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            encoded = [(text, ids[-keep:] if keep > 0 else []) for text, ids in encoded]
        req_ids = [f"llm-{next(self._ids)}" for _ in encoded]
        vectors: dict[str, list[float]] = {}
        progress = _Progress(len(encoded), use_tqdm, "Embedding")
        try:
            for req_id, (_, ids) in zip(req_ids, encoded, strict=True):
                self.engine.add_request(EngineRequest(req_id, ids, pooling_params()))
            while self.engine.has_work():
                result = self.engine.step_with_batch_queue()
                for out in [] if result is None else result.outputs:
                    if out.finished and out.embedding is not None:
                        vectors[out.req_id] = out.embedding
                        progress.done(0)
        except BaseException:
            self._abort_all(req_ids)
            raise
        finally:
            progress.close()
        return [EmbeddingRequestOutput(r, EmbeddingOutput(vectors[r]), ids, text)
                for r, (text, ids) in zip(req_ids, encoded, strict=True)]

    # ---- internals ----------------------------------------------------------------------------
    def _check_runner(self, runner: str, method: str) -> None:
        if self.is_paused() or self.is_sleeping():
            raise RuntimeError(f"{method}: the engine is {'asleep' if self.is_sleeping() else 'paused'} "
                               "(wake_up() / resume() first)")
        if self.runner != runner:
            raise ValueError(f"LLM.{method} needs runner={runner!r}; this LLM was built with runner={self.runner!r}")

    def _loras(self, lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each read whole and checked against the model (ValueError says why),
        as it runs: with the digest of the content checked, which the worker gets from ``self._adapters``."""
        loras = [lora] * n if lora is None or isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
        if any(x is not None for x in loras) and not self.model_config.enable_lora:
            raise ValueError("a lora_request needs an LLM built with enable_lora=True")
        given = [x for x in loras if x is not None]
        for x in given:
            if not isinstance(x, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest or None, got {type(x).__name__}")
        checked = self._adapters.check(dict.fromkeys(given))
        return [None if x is None else checked[x] for x in loras]

    def _abort_all(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.engine.abort_request(req_id)
        while self.engine.has_work():
            self.engine.step_with_batch_queue()

    def _encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if prompt and isinstance(prompt[0], dict):
            ids = apply_chat_template(self.tokenizer, prompt)  # type: ignore[arg-type]
            return self.tokenizer.decode(ids), ids
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)  # type: ignore[arg-type]
        raise TypeError(f"a prompt must be text, token ids or chat messages, got {type(prompt).__name__}")

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: bool,
        loras: list[LoRARequest | None], kv: KVTransferParams | None = None,
    ) -> list[GenerateOutput]:
        grammars = self.executor.runner.structured.compilers if any(p.structured for p in params) else None
        for sp in params:  # a spec that does not compile: ValueError here, not in the engine
            if sp.structured is not None and grammars is not None:
                grammars.get(sp.structured)
        req_ids = [f"llm-{next(self._ids)}" for _ in encoded]
        progress = _Progress(len(encoded), use_tqdm)
        try:
            for req_id, (text, ids), sp, lora in zip(req_ids, encoded, params, loras, strict=True):
                self.engine.add_request(self.processor.add_request(req_id, ids, sp, prompt=text, lora=lora,
                                                                   kv_transfer=kv))
            while self.engine.has_work():
                result = self.engine.step_with_batch_queue()
                for out in [] if result is None else result.outputs:
                    state = self.processor.requests.get(out.req_id)
                    if state is not None and state.process(out) is not None and state.finished:
                        progress.done(state.num_completion_tokens)
        except BaseException:
            self._abort_all(req_ids)
            raise
        finally:
            states = [self.processor.pop(r) for r in req_ids]
            progress.close()
        return [s.result for s in states if s is not None]

    # ---- an RL loop's controls (vLLM's LLM.sleep / wake_up / reset_prefix_cache; served: cluster/engine/rollout.py) --
    def pause(self, mode: str = "keep") -> None:
        """Hold the engine ("abort": end what it holds); ``generate`` is refused until ``resume``."""
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def is_paused(self) -> bool:
        return self.engine.scheduler.pause_mode is not None

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV cache (level 1) and the weights (level 2) until ``wake_up`` (``enable_sleep_mode``)."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: build the LLM with enable_sleep_mode=True")
        if not self.executor.runner.is_sleeping:
            self.engine.drop_kv()
        return dict(self.executor.runner.sleep(level))

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return dict(self.executor.runner.wake_up(tags))

    def is_sleeping(self) -> bool:
        return bool(self.executor.runner.is_sleeping)

    def reset_prefix_cache(self) -> int:
        """No cached KV block is served again; returns how many the cache forgot."""
        return self.engine.scheduler.kv.reset_prefix_cache()

    def update_weights(self, weights: Any, version: int | None = None) -> dict[str, Any]:
        """Load HF-named tensors (a ``state_dict()`` or pairs; all of the model's or some) in place; no block cached
        before is served after. ``version`` (default: the current + 1) is each output's ``weights_version``."""
        from cbserve.rl.weight_sync import named_tensors

        report = dict(self.executor.runner.update_weights(named_tensors(weights)))
        new = self.engine.weights_version + 1 if version is None else version
        self.engine.set_weights_version(new)
        return {**report, "version": new}

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def _finish_on_stop(self, req_id: str, index: int) -> None:
        """A stop string ended a sequence: the engine stops generating it."""
        self.engine.finish_request(req_id, index, "stop")

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __repr__(self) -> str:
        return f"LLM(model={self.model_config.model!r}, max_model_len={self.max_model_len})"


def _as_prompt_list(prompts: Any) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes) or len(prompts) == 0:
        raise TypeError("prompts must be a prompt or a non-empty list of prompts")
    first = prompts[0]
    if isinstance(first, (int, dict)):  # one token-id prompt or one conversation
        return [list(prompts)]
    return list(prompts)


def _as_params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sps = list(sp)
    if len(sps) != n:
        raise ValueError(f"got {len(sps)} sampling params for {n} prompts")
    return sps


class _Progress:
    """The tqdm bar of one generate() call: finished prompts, with the output throughput."""

    def __init__(self, total: int, enabled: bool, desc: str = "Generating") -> None:
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not enabled)
        self.start = time.perf_counter()
        self.num_output_tokens = 0

    def done(self, num_output_tokens: int) -> None:
        self.num_output_tokens += num_output_tokens
        self.bar.update()
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.num_output_tokens / elapsed:.1f} output tok/s", refresh=False)

    def close(self) -> None:
        self.bar.close()
