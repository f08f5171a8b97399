"""ModelRunner: one worker's model, KV cache and sampler; turns a SchedulerOutput into a ModelRunnerOutput."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from cbserve.worker.attention.backend import AttentionMetadataBuilder, KVCache
from cbserve.worker.config import ModelConfig
from cbserve.worker.cpu.malloc import tune_malloc_for_cpu_inference
from cbserve.worker.cuda.graphs import CaptureFn, DecodeCUDAGraphs, maybe_capture_decode_graphs
from cbserve.worker.cuda.piecewise_graphs import PieceCaptureFn, PiecewiseCUDAGraphs, maybe_capture_piecewise_graphs
from cbserve.worker.faults import FaultPlan
from cbserve.worker.kv.tiers import build_kv_tiers
from cbserve.worker.loading.model_build import build_model
from cbserve.worker.loading.model_info import read_eos_token_ids
from cbserve.worker.loading.model_loader import hide_triton_from_torch, load_hf_config, resolve_model
from cbserve.worker.loading.pooling_config import read_pooling_config
from cbserve.worker.loading.sleep_mode import SleepMode
from cbserve.worker.loading.weight_update import update_model_weights
from cbserve.worker.lora.files import LoRAAdapterError
from cbserve.worker.lora.manager import LoRAManager
from cbserve.worker.parallel import broadcast_token_ids, divide, tp_rank, tp_world_size
from cbserve.worker.runner.block_table import BlockTable
from cbserve.worker.runner.draft_model import DraftModel
from cbserve.worker.runner.input_batch import CachedRequestState, PreparedBatch, build_batch, order_decode_first
from cbserve.worker.runner.kv_cache import allocate_kv_cache, bytes_per_block, copy_blocks, num_blocks_for_budget
from cbserve.worker.runner.pooler import Pooler
from cbserve.worker.runner.profiling import profile_cuda_kv_budget
from cbserve.worker.runner.prompt_logprobs import compute_prompt_logprobs
from cbserve.worker.runner.step_buffers import StepBuffers
from cbserve.worker.sampling.sampler import Sampler, to_device
from cbserve.worker.sampling.spec_verify import verify_drafts
from cbserve.worker.sampling.structured import StructuredOutputs
from cbserve.worker.shapes import head_dim_of, num_kv_heads_of

logger = logging.getLogger(__name__)


def _check_runner_args(config: ModelConfig) -> None:
    if config.tensor_parallel_size != tp_world_size():
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} but torch.distributed has "
            f"{tp_world_size()} rank(s): initialise the process group first"
        )


class ModelRunner:
    """Holds the model shard, the paged KV cache and per-request state of one (tensor-parallel) rank.

    Usage: ``runner = ModelRunner(cfg)``; ``runner.init_kv_cache(runner.determine_num_blocks())``;
    then ``runner.execute_model(scheduler_output)`` every iteration.
    """

    def __init__(
        self,
        config: ModelConfig,
        progress: bool = True,
        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> None:
        """``weights``: HF-named tensors to load instead of the model folder's (see ``build_model``)."""
        _check_runner_args(config)
        self.config = config
        block_size, max_num_seqs = config.block_size, config.max_num_seqs
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        if self.device.type == "cpu":
            hide_triton_from_torch()  # before transformers first loads torch._dynamo (see model_loader)
        torch.manual_seed(config.seed)
        self.model_folder: Path = resolve_model(config.model).folder
        self.hf_config = load_hf_config(self.model_folder)
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 0) or 1 << 30)
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        built = build_model(self.model_folder, self.hf_config, config, self.device, self.dtype, self.max_model_len,
                            progress and tp_rank() == 0, weights)
        self.model, self.cpu_ops, self.backend_cls = built.model, built.cpu_ops, built.backend_cls
        # The runner owns each step's attention plan: built once a step, before the forward pass, for every layer.
        self.attention_builder: AttentionMetadataBuilder = self.model.attention_backend.make_builder(
            self.model.attention_layout)
        self.dtype = built.dtype  # float32 for bfloat16 products on the CPU kernels (see cpu/ops.py)
        self.cpu_report = built.cpu_report  # the CPU path: mode, kernels' ISA level, probe figures (/stats)
        if self.device.type == "cpu":
            tune_malloc_for_cpu_inference()  # after the weights are placed: they stay in their own mappings
        self.eos_token_ids = list(read_eos_token_ids(self.model_folder))
        self.sampler = Sampler(self.eos_token_ids, built.kernels)
        vocab = int(self.hf_config.vocab_size)
        self.structured = StructuredOutputs(self.model_folder, vocab, self.eos_token_ids)  # grammar matchers
        self.num_kv_heads = divide(num_kv_heads_of(self.hf_config), tp_world_size(), "num_key_value_heads")
        self.head_dim = head_dim_of(self.hf_config)
        self.kv_tiers = build_kv_tiers(self)  # None unless kv_offloading_bytes
        self.kv_caches: list[KVCache] = []
        self.graphs: DecodeCUDAGraphs | None = None
        self.piecewise: PiecewiseCUDAGraphs | None = None
        self.num_blocks = 0
        self.requests: dict[str, CachedRequestState] = {}  # their block tables kept in step (block_table.py)
        self.block_table, self.step_buffers = BlockTable(max_num_seqs), StepBuffers(self.device)
        self.draft: DraftModel | None = None  # speculative decoding with a draft model (draft_model.py)
        if config.draft_model is not None:
            self.draft = DraftModel(config, self.model_folder, vocab, block_size, max_num_seqs, self.max_model_len)
        self.pooler = self._pooler() if config.runner == "pooling" else None  # embeddings instead of samples
        self.structured.fault = self.faults = FaultPlan.of(self.hf_config)  # a test model's fault (faults.py)
        self.lora: LoRAManager | None = None  # adapter slots and loaded adapters (lora.py)
        if config.enable_lora:
            self.lora = LoRAManager(self.model, self.hf_config, config.max_loras, config.max_lora_rank,
                                    config.lora_cache_size, self.dtype, self.device)
        self.sleep_mode = SleepMode(reloadable=weights is None)  # sleep / wake_up (loading/sleep_mode.py)

    def _pooler(self) -> Pooler:
        pooling = read_pooling_config(self.model_folder)
        logger.info("pooling runner: %s pooling%s (from %s)", pooling.pooling_type,
                    ", normalized" if pooling.normalize else "", pooling.source)
        return Pooler(pooling, lambda x: self.model.model.norm(x)[0])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    # ---- KV cache ------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        own = bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                              self.config.kv_fp8)
        return own + (self.draft.block_bytes() if self.draft is not None else 0)  # the draft mirrors every block

    def determine_num_blocks(self) -> int:
        """Blocks that fit: from kv_cache_memory_bytes on CPU; on CUDA from gpu_memory_utilization after
        the weights and a profiling forward pass at the largest batch."""
        if self.device.type == "cuda":
            budget = profile_cuda_kv_budget(self, self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory_bytes
        return num_blocks_for_budget(budget, self.block_bytes())

    def allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        return allocate_kv_cache(self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                                 self.dtype, self.device, self.config.kv_fp8)

    def init_kv_cache(self, num_blocks: int, capture: CaptureFn | None = None,
                      piece_capture: PieceCaptureFn | None = None) -> None:
        """Allocate the KV cache, then capture the decode CUDA graphs over it (CUDA, a backend that supports
        them, ``enforce_eager`` off) and, with ``cudagraph_mode: full_and_piecewise``, the piecewise graphs of
        steps with prefill chunks (``capture`` / ``piece_capture``: stand-ins for the CUDA capture, for tests)."""
        self.graphs = self.piecewise = None  # graphs of an earlier cache point at its tensors
        self.kv_caches = self.allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        if self.kv_tiers is not None:
            self.kv_tiers.register_kv_caches(self.kv_caches)
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks)
        if self.lora is None:  # a step's adapters change between steps: no graphs with LoRA
            self.graphs = maybe_capture_decode_graphs(self, capture)
            self.piecewise = maybe_capture_piecewise_graphs(self, piece_capture)

    # ---- one iteration -------------------------------------------------------------------------
    def drop(self, req_ids: set[str]) -> None:
        """Forget these requests (finished or preempted; ids not held are no error)."""
        self._forget(req_ids)
        self.block_table.update(req_ids, (), ())

    def _forget(self, req_ids: set[str]) -> None:
        """``drop`` but for the block table's rows."""
        for req_id in req_ids:
            self.requests.pop(req_id, None)
        self.structured.drop(req_ids)
        if self.draft is not None:
            self.draft.drop(req_ids)

    def _update_states(self, so: SchedulerOutput) -> None:
        gone = so.finished_req_ids | so.preempted_req_ids
        self._forget(gone)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState.from_new(new)
        for cached in so.scheduled_cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise KeyError(f"cached request {cached.req_id!r} is unknown to the worker")
            state.update(cached)
        self.block_table.update(gone, [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs],
                                [(c.req_id, c.new_block_ids) for c in so.scheduled_cached_reqs])

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the KV tiers' moves first (worker/kv/tiers.py), then the forward pass and sampling."""
        if not self.kv_caches:  # never allocated, or released by sleep() (which the error then names)
            self.sleep_mode.check_awake("execute_model()")
            raise RuntimeError("init_kv_cache() must be called before execute_model()")
        tiers = self.kv_tiers
        if tiers is None:
            return self._execute(so)
        if so.kv_transfer is not None:
            tiers.start_load_kv(so.kv_transfer)
            if so.kv_transfer.poll and not so.num_scheduled_tokens:
                tiers.wait_for_prefetch()
        out = self._execute(so)
        out.kv_transfer = tiers.get_finished()
        return out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(so)
        copy_blocks(self.kv_caches, so.block_copies)
        if self.draft is not None:
            self.draft.copy_blocks(so.block_copies)
        if so.total_num_scheduled_tokens == 0 or not so.num_scheduled_tokens:
            return ModelRunnerOutput(forward_time_s=time.perf_counter() - t0)
        states = [self.requests[r] for r in so.num_scheduled_tokens]
        states = order_decode_first(states, so.num_scheduled_tokens, by_adapter=self.lora is not None)
        spec = so.scheduled_spec_decode_tokens
        batch = build_batch(states, so.num_scheduled_tokens, self.block_size, self.device, spec, self.block_table,
                            self.step_buffers)
        if self.faults is not None:
            self.faults.check_step(batch.input_ids)
        if self.lora is not None:
            self._prepare_lora(self.lora, states, batch.metadata.query_lens_cpu)
        hidden = self._hidden(batch)
        if self.pooler is not None:
            return self._pool(so, states, hidden, t0)
        logits = self._logits(batch, hidden)
        out, failure = ModelRunnerOutput(), None
        if tp_rank() == 0:  # a failure here is kept until the collectives below are through on every rank
            try:
                out = self._sample(batch, logits)
            except Exception as e:
                failure = e
        if batch.prompt_lp:  # every rank: the LM head is a collective under tensor parallelism
            lps = compute_prompt_logprobs(hidden, batch.prompt_lp, self.model.compute_logits, tp_rank() == 0)
            out.prompt_logprobs = lps
        for state in states:
            state.num_computed_tokens += so.num_scheduled_tokens[state.req_id]
        self._keep_samples(batch, out, spec, failure)
        if self.draft is not None:
            self.draft.run(batch)  # its cache in step with the target's
            sampled = [self.requests[r] for r in batch.sampled_req_ids]
            out.draft_token_ids = self.draft.propose(sampled, self.sampler)
        out.forward_time_s = time.perf_counter() - t0
        return out

    @staticmethod
    def _prepare_lora(lora: LoRAManager, states: list[CachedRequestState], lengths: list[int]) -> None:
        """The step's adapters in their slots; one that cannot be loaded fails the requests using it alone."""
        try:
            lora.prepare_step([s.lora for s in states], lengths)
        except LoRAAdapterError as e:
            lid = getattr(e, "lora_int_id", None)
            culprits = [s.req_id for s in states if s.lora is not None and s.lora.lora_int_id == lid]
            raise StepFailedError(f"LoRA adapter: {e}", culprits, client_error=True) from e

    def _pool(self, so: SchedulerOutput, states: list[CachedRequestState], hidden: torch.Tensor,
              t0: float) -> ModelRunnerOutput:
        """The pooling runner's step: no logits, no samples; the embeddings of the prompts this step completed."""
        lens = [so.num_scheduled_tokens[s.req_id] for s in states]
        pooled = self.pooler(hidden, states, lens) if self.pooler is not None and tp_rank() == 0 else {}
        for state, n in zip(states, lens, strict=True):
            state.num_computed_tokens += n
        return ModelRunnerOutput(pooled=pooled, forward_time_s=time.perf_counter() - t0)

    def forward_logits(self, batch: PreparedBatch, kv_caches: list[KVCache]) -> torch.Tensor | None:
        """Logits of the batch's ``logits_rows`` (None when there are none), run eagerly over ``kv_caches``
        (memory profiling runs it over a scratch cache)."""
        batch.metadata.prepared = self.attention_builder.build(batch.metadata)
        hidden = self.model(batch.input_ids, batch.positions, kv_caches, batch.metadata)
        return self._logits(batch, hidden)

    def _logits(self, batch: PreparedBatch, hidden: torch.Tensor) -> torch.Tensor | None:
        if batch.logits_rows.numel() == 0:
            return None
        return self.model.compute_logits(hidden.index_select(0, batch.logits_rows))

    def _hidden(self, batch: PreparedBatch) -> torch.Tensor:
        """The final hidden states of every token of the batch. A decode-only batch that fits a captured
        CUDA graph replays it; anything else runs eagerly."""
        md, n = batch.metadata, batch.input_ids.shape[0]
        if self.graphs is not None and self.graphs.can_run(n, md):
            hidden = self.graphs.run(batch.input_ids, batch.positions, md)
        elif self.piecewise is not None and self.piecewise.can_run(n):
            md.prepared = self.attention_builder.build(md)  # the attention runs eagerly between the pieces
            hidden = self.piecewise.run(batch.input_ids, batch.positions, md)
        else:
            md.prepared = self.attention_builder.build(md)  # once per step, for every layer
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, md)
        return hidden

    def _sample(self, batch: PreparedBatch, logits: torch.Tensor | None) -> ModelRunnerOutput:
        out = ModelRunnerOutput(req_ids=list(batch.sampled_req_ids))
        if logits is None:
            return out
        rows_logits = logits  # index copies from pinned memory: no host sync on CUDA (see sampler.to_device)
        if len(batch.sample_owner) != logits.shape[0]:
            rows_logits = logits.index_select(0, to_device(batch.sample_owner, torch.long, logits.device))
        sampled: list[list[int]] = [[] for _ in batch.sampled_req_ids]
        lps: list[list[TokenLogprob] | None] = [None for _ in batch.sampled_req_ids]
        plain = list(range(len(batch.sample_rows)))
        if batch.draft_groups:  # one logits row per sample row; the drafts' rows are verified apart
            groups = batch.draft_groups
            if self.draft is not None:  # the draft's distributions, for rejection sampling
                groups = [g.with_q(self.draft.q_for(self.requests[batch.sampled_req_ids[g.owner]], g.drafts))
                          for g in groups]
            verified = verify_drafts(self.sampler, rows_logits, batch.sample_rows, groups)
            in_groups = set()
            for g, (tokens_g, lps_g) in zip(groups, verified, strict=True):
                sampled[g.owner], lps[g.owner] = tokens_g, lps_g
                in_groups.update(range(g.first_row, g.first_row + len(g.drafts) + 1))
            plain = [j for j in plain if j not in in_groups]
            if plain and len(plain) != len(batch.sample_rows):
                rows_logits = rows_logits.index_select(0, to_device(plain, torch.long, rows_logits.device))
        if plain:
            ids, rows = batch.sampled_req_ids, [batch.sample_rows[j] for j in plain]
            owners = [ids[batch.sample_owner[j]] for j in plain]
            bitmask = self.structured.bitmask(
                [(rid, self.requests.get(rid), r) for rid, r in zip(owners, rows, strict=True)]
            )
            tokens, logprobs = self.sampler(rows_logits, rows, bitmask)
            for t, j in enumerate(plain):
                o = batch.sample_owner[j]
                sampled[o].append(tokens[t])
                if logprobs[t] is not None:
                    lps[o] = (lps[o] or []) + [logprobs[t]]  # type: ignore[operator]
        out.sampled_token_ids = sampled
        out.logprobs = lps
        return out

    def _keep_samples(self, batch: PreparedBatch, out: ModelRunnerOutput, spec: dict[str, list[int]],
                      failure: Exception | None = None) -> None:
        """Append each sequence's one sampled token to the worker's own copy: the scheduler never sends a
        sample back (with async scheduling it schedules the next token before it knows it). Not for n > 1
        fork points and beam search, whose tokens the scheduler decides. Every rank appends rank 0's.
        A request with drafts keeps its accepted drafts + one token and rolls back the rest: computed up
        to its last token, block table cut to the blocks its tokens need (as spec_decode.rollback)."""
        sampled = broadcast_token_ids(out.sampled_token_ids if tp_rank() == 0 else None,  # no pickle
                                      len(batch.sampled_req_ids), len(batch.sample_rows), self.device,
                                      failed=failure is not None)
        if failure is not None:  # rank 0's sampling failed: every rank fails the step (told by the broadcast)
            raise failure
        bs = self.block_size
        for req_id, tokens in zip(batch.sampled_req_ids, sampled, strict=True):
            state = self.requests[req_id]
            if spec and req_id in spec:
                state.token_ids.extend(tokens)
                state.num_computed_tokens = len(state.token_ids) - 1
                self._truncate_blocks(state, -(-len(state.token_ids) // bs))
            elif len(tokens) == 1 and not state.sampling_params.use_beam_search:
                state.token_ids.append(tokens[0])

    def _truncate_blocks(self, state: CachedRequestState, num_blocks: int) -> None:
        """The one place a request's blocks shrink: its state's list and its row of the block table."""
        del state.block_ids[num_blocks:]
        self.block_table.truncate(state.req_id, num_blocks)

    # ---- RL loops: weights updated in place, sleep and wake (loading/weight_update.py, loading/sleep_mode.py) ---
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Load HF-named full tensors into the model in place (all checked first: ValueError, nothing changed) and
        re-pack what they change; the report of ``WeightUpdateReport.as_dict``. The draft model is not updated."""
        self.sleep_mode.check_weights("update_weights()")
        return update_model_weights(self.model, weights, self.config.cpu_compact_weights).as_dict()

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV cache (level 1) and the weights (level 2); the requests held are dropped."""
        return self.sleep_mode.sleep(self, level)

    def wake_up(self, tags: Iterable[str] | None = None) -> dict[str, Any]:
        """Reload what ``sleep`` freed: ``tags`` within {"weights", "kv_cache"}, None for both."""
        return self.sleep_mode.wake_up(self, tags)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping

    def shutdown(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.shutdown()
        self.graphs = self.piecewise = None
        self.kv_caches = []
        self.requests.clear()
        self.block_table = BlockTable()
        self.structured.drop(list(self.structured.matchers))
