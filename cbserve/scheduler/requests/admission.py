"""What ``EngineCore.add_request`` refuses before a request enters the engine: an id already in use (sequence ids
share one namespace at the worker) and a request that could never run (``validate_request``: LoRA off, the length
rule of limits.py, more KV blocks than the whole cache, beam search beside speculative decoding, retention hints
the operator's limits do not allow) or a part in prefill/decode disaggregation this engine cannot play
(``kv_transfer_request``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from cbserve.scheduler.config import MAX_RETENTION_PRIORITY, EngineConfig
from cbserve.scheduler.errors import DuplicateRequestError, RequestRejectedError
from cbserve.scheduler.requests.limits import check_pooling_prompt, resolve_max_tokens
from cbserve.scheduler.requests.request import EngineRequest
from cbserve.scheduler.requests.retention import Retention, check_retention
from cbserve.scheduler.requests.sequence import SequenceGroup, child_seq_id


def admit(cfg: EngineConfig, groups: Mapping[str, SequenceGroup], request: EngineRequest) -> tuple[EngineRequest, int]:
    """The request as the engine runs it and its effective max_tokens; or why not: DuplicateRequestError (an id in
    use), RequestRejectedError (it could never run here). (A full waiting queue refuses it next: waiting_queue.py.)"""
    if id_in_use(groups, request):
        raise DuplicateRequestError(f"request id {request.req_id!r} is already in the engine")
    max_tokens = validate_request(cfg, request)
    request = request if request.kv_transfer is None else kv_transfer_request(cfg, request)
    return request, max_tokens


def id_in_use(groups: Mapping[str, SequenceGroup], request: EngineRequest) -> bool:
    """Whether one of the request's sequence ids is taken: "x" with n=2 owns "x" and "x#1"."""
    for i in range(request.sampling_params.num_sequences):
        seq_id = child_seq_id(request.req_id, i)
        if seq_id in groups:
            return True
        base, sep, index = seq_id.rpartition("#")
        owner = groups.get(base) if sep and index.isdigit() else None
        if owner is not None and (owner.mode == "beam" or int(index) < owner.params.num_sequences):
            return True  # beam search forks children with ever-growing indices
    return False


def validate_request(cfg: EngineConfig, request: EngineRequest) -> int:
    """Reject what could never run (RequestRejectedError). Returns the effective max_tokens."""
    num_prompt = len(request.prompt_token_ids)
    if request.lora is not None and not cfg.scheduler.max_loras:
        raise RequestRejectedError(f"adapter {request.lora.lora_name!r}: LoRA is not enabled on this engine")
    if cfg.runner == "pooling":
        return check_pooling_prompt(num_prompt, cfg.scheduler.max_model_len, request.sampling_params)
    max_tokens = resolve_max_tokens(num_prompt, request.sampling_params.max_tokens, cfg.scheduler.max_model_len)
    if request.retention:
        _check_retention(cfg, request, num_prompt)
    # The last generated token is never computed, so its KV needs no slot.
    blocks = math.ceil((num_prompt + max_tokens - 1) / cfg.cache.block_size)
    if blocks > cfg.cache.num_blocks:
        raise RequestRejectedError(
            f"the request needs {blocks} KV cache blocks (prompt {num_prompt} + max_tokens {max_tokens} "
            f"tokens) but the whole cache has only {cfg.cache.num_blocks} blocks"
        )
    params = request.sampling_params
    if params.use_beam_search and cfg.speculative is not None:
        raise RequestRejectedError(
            "beam search does not combine with speculative decoding (speculative_config is set on this "
            "engine): use sampling or greedy decoding"
        )
    if params.use_beam_search:  # all beams live at once: they share the prompt's blocks only
        bs, width = cfg.cache.block_size, params.beam_width
        if cfg.cache.enable_prefix_caching:
            blocks = math.ceil(num_prompt / bs) + width * (math.ceil(max_tokens / bs) + 1)
        else:  # a preempted beam is recomputed into blocks of its own: no prefix hits on its siblings'
            blocks = width * math.ceil((num_prompt + max_tokens) / bs)
        if blocks > cfg.cache.num_blocks:
            raise RequestRejectedError(
                f"beam search with width {params.beam_width} needs up to {blocks} KV cache blocks "
                f"but the whole cache has only {cfg.cache.num_blocks} blocks"
            )
    return max_tokens


def _check_retention(cfg: EngineConfig, request: EngineRequest, num_prompt: int) -> None:
    if not cfg.cache.enable_prefix_caching:
        raise RequestRejectedError("retention hints keep prefix-cache blocks: this engine runs without prefix caching")
    try:
        check_retention(request.retention, num_prompt, cfg.cache.retention)
    except ValueError as e:
        raise RequestRejectedError(str(e)) from e


def kv_transfer_request(cfg: EngineConfig, request: EngineRequest) -> EngineRequest:
    """The request as this engine plays its part in prefill/decode disaggregation (kv_transfer.py): a
    ``remote_decode`` one keeps its prompt's blocks for a decode engine (a retention hint of ``transfer_timeout_s``)
    and carries the answer its last output gives. RequestRejectedError where this engine has no such part."""
    kt = request.kv_transfer
    if kt is None:
        return request
    offload = cfg.cache.offload
    role = None if offload is None else offload.role
    if not kt.remote_decode:
        if role not in ("kv_consumer", "kv_both"):
            raise RequestRejectedError("kv_transfer_params do_remote_prefill: this engine pulls no KV (start it "
                                       "with kv_transfer_config kv_role 'kv_consumer' or 'kv_both')")
        return request
    if offload is None or offload.shm_name is None or role not in ("kv_producer", "kv_both"):
        raise RequestRejectedError("kv_transfer_params do_remote_decode: this engine publishes no KV (start it with "
                                   "kv_transfer_config kv_role 'kv_producer' or 'kv_both')")
    sp = request.sampling_params
    if request.lora is not None or sp.num_sequences > 1 or sp.use_beam_search or sp.prompt_logprobs is not None:
        raise RequestRejectedError("kv_transfer_params do_remote_decode takes one sampled sequence of the base model "
                                   "without prompt_logprobs (n=1, no best_of, beam search or LoRA adapter)")
    n = len(request.prompt_token_ids)
    keep = Retention(0, n, MAX_RETENTION_PRIORITY, offload.transfer_timeout_s)
    answer = kt.published(offload.shm_name, n, cfg.cache.block_size)
    return replace(request, retention=(*request.retention, keep), kv_transfer=replace(kt, answer=answer))
