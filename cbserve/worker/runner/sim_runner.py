"""SimRunner: the simulated engine's worker (``model: sim``), in place of ``ModelRunner`` where a runner is
built (``LocalExecutor``, ``cluster/engine/worker_actor.py``). No weights, no torch: each step keeps the requests'
state as the real runner does (``scheduler/outputs.py``'s protocol), sleeps for what ``SimCostModel`` says the
step costs on an H100 serving Llama-3-8B, and returns a token for every sequence that reaches the end of its
known tokens. Everything above it (scheduler, KV-cache manager, channels, router, ingress, HTTP) runs as usual.

The tokens are pseudo-random ids of the bundled SmolLM2 tokenizer's vocabulary (the front end detokenizes them
with it), deterministic per (request, position), and never one of its special ids (0-16): a sequence never
samples EOS and runs to ``max_tokens`` or a stop string. Sampling parameters (temperature, penalties, seeds,
structured output, beam search's scores) do not change them, and prompt logprobs are not produced: the sim
measures the serving layer, not the answers. ``logprobs`` get placeholder values (0.0 for the sampled token).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from cbserve.worker.config import ModelConfig
from cbserve.worker.sim_cost import SimCostModel

SIM_VOCAB_SIZE = 49152  # SmolLM2's tokenizer (the bundled GGUF's config.json vocab_size)
SIM_FIRST_PLAIN_TOKEN = 17  # ids 0-16 are its special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...)


@dataclass(slots=True)
class _SimRequest:
    num_tokens: int  # tokens the worker knows (prompt + samples it kept)
    num_prompt_tokens: int
    num_computed_tokens: int
    num_samples: int
    key: int  # crc32 of the request id: the tokens' seed
    logprobs: int | None
    keeps_samples: bool  # not under beam search, whose tokens the scheduler picks and sends


class _HFConfig:
    """The little of a transformers config the offline ``LLM`` reads (``to_dict``)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)


def sim_token(key: int, position: int, sample: int = 0) -> int:
    """The token at ``position`` of the sequence whose id hashes to ``key`` (``sample``: an n > 1 fork's i)."""
    mixed = (key * 0x9E3779B1 + position * 0x85EBCA77 + sample * 0xC2B2AE3D) & 0xFFFFFFFF
    mixed ^= mixed >> 15
    return SIM_FIRST_PLAIN_TOKEN + mixed % (SIM_VOCAB_SIZE - SIM_FIRST_PLAIN_TOKEN)


class SimRunner:
    """``ModelRunner``'s interface where it is used, over ``SimCostModel``. ``sleep`` and ``clock``: injected by
    tests (a step sleeps until ``cost`` seconds after it started, so its own bookkeeping is part of the cost)."""

    def __init__(
        self,
        config: ModelConfig,
        progress: bool = True,
        weights: Iterable[Any] | None = None,
        *,
        cost: SimCostModel | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if weights is not None:
            raise ValueError("the simulated model has no weights to load")
        if config.tensor_parallel_size != 1:
            raise ValueError("the simulated model runs on one (simulated) GPU: tensor_parallel_size must be 1")
        self.config = config
        self.block_size = config.block_size
        self.cost = cost or SimCostModel()
        self.sleep, self.clock = sleep, clock
        model_max = self.cost.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        self.hf_config = _HFConfig(self.cost.hf_config(SIM_VOCAB_SIZE))
        self.cpu_report: dict[str, Any] | None = None
        self.kv_tiers = None  # no KV to keep (refused: config/sim_config.py)
        self.num_blocks = 0
        self.requests: dict[str, _SimRequest] = {}
        self.busy_s = 0.0  # simulated GPU time so far (steps' costs)

    @property
    def model_folder(self) -> Path:
        """The bundled SmolLM2 folder: its tokenizer is the sim's (converted from the GGUF on first use)."""
        from cbserve.worker.loading.model_loader import resolve_model

        return resolve_model(None).folder

    # ---- KV cache ------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        return self.cost.block_bytes(self.block_size)

    def determine_num_blocks(self) -> int:
        """Blocks an H100 would hold at ``gpu_memory_utilization`` after the weights (nothing is allocated)."""
        return self.cost.num_blocks(self.block_size, self.config.gpu_memory_utilization)

    def init_kv_cache(self, num_blocks: int, capture: Any = None) -> None:
        self.num_blocks = num_blocks

    # ---- one iteration -------------------------------------------------------------------------
    def drop(self, req_ids: set[str]) -> None:
        """Forget these requests (ids not held are no error)."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    def _update_states(self, so: SchedulerOutput) -> None:
        self.drop(so.finished_req_ids | so.preempted_req_ids)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = _SimRequest(
                len(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens, new.num_samples,
                zlib.crc32(new.req_id.encode()), new.sampling_params.logprobs,
                not new.sampling_params.use_beam_search)
        for cached in so.scheduled_cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise KeyError(f"cached request {cached.req_id!r} is unknown to the worker")
            state.num_tokens += len(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.scheduled_spec_decode_tokens:
            raise ValueError("the simulated model does not verify speculative drafts")
        t0 = self.clock()
        self._update_states(so)
        out = ModelRunnerOutput()
        shape: list[tuple[int, int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            end = state.num_computed_tokens + n
            if n < 1 or end > state.num_tokens:
                raise ValueError(f"request {req_id}: {n} tokens scheduled from {state.num_computed_tokens}, "
                                 f"{state.num_tokens} known")
            shape.append((n, end))
            state.num_computed_tokens = end
            if end == state.num_tokens:
                self._sample(req_id, state, out)
        step = self.cost.step_time(shape, sum(len(t) for t in out.sampled_token_ids))
        self.busy_s += step
        remaining = t0 + step - self.clock()
        if remaining > 0:
            self.sleep(remaining)
        out.forward_time_s = step
        return out

    def _sample(self, req_id: str, state: _SimRequest, out: ModelRunnerOutput) -> None:
        k = state.num_samples if state.num_tokens == state.num_prompt_tokens else 1
        tokens = [sim_token(state.key, state.num_tokens, i) for i in range(k)]
        out.req_ids.append(req_id)
        out.sampled_token_ids.append(tokens)
        out.logprobs.append(None if state.logprobs is None else [_placeholder_logprob(t, state.logprobs)
                                                                 for t in tokens])
        if k == 1 and state.keeps_samples:  # as ModelRunner._keep_samples (forks: the scheduler sends them)
            state.num_tokens += 1

    def shutdown(self) -> None:
        self.requests.clear()


def _placeholder_logprob(token: int, top: int) -> TokenLogprob:
    alternatives = [(token, 0.0)] + [(SIM_FIRST_PLAIN_TOKEN + (token + i) % (SIM_VOCAB_SIZE - SIM_FIRST_PLAIN_TOKEN),
                                      -float(i)) for i in range(1, top)]
    return TokenLogprob(token, 0.0, 1, alternatives[:top])
