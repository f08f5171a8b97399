"""Speculative decoding with a draft model: a smaller model with the target's vocabulary, on the same worker.

Its paged KV cache mirrors the target's: the same number of blocks, indexed by the same block ids and
slots, so the scheduler's allocation covers both and copy-on-write copies both (``ModelRunner``). Each step:

1. ``run``: the draft computes the very batch the target computed (the same token ids, positions, slots:
   prefill chunks, decodes, verification rows with their drafts), so its cache holds every position the
   target has computed, prefix-cached blocks and recomputation after preemption included. Positions of
   rejected drafts are simply overwritten when the target computes them again.
2. ``propose``: after sampling, for each request that sampled one token (no fork points, beams or
   structured output), ``k`` autoregressive draft steps from its last token: greedy requests take the
   draft's argmax, random ones draw from the draft's distribution q (the sampler's processing of the
   draft's logits with the request's parameters), kept here for the verification (rejection sampling
   needs q). Positions past the request's allocated blocks go to a few scratch blocks per row, placed
   after the mirrored ones; the next step's ``run`` recomputes whatever the scheduler kept in real slots.

The proposals go back to the scheduler in ``ModelRunnerOutput.draft_token_ids``; the scheduler may cut
them to the room left (``spec_decode.WorkerProposer``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbserve.worker.attention.backend import AttentionMetadataBuilder, KVCache
from cbserve.worker.config import ModelConfig
from cbserve.worker.loading.model_build import build_model
from cbserve.worker.loading.model_loader import load_hf_config, resolve_model
from cbserve.worker.runner.input_batch import CachedRequestState, PreparedBatch, build_batch
from cbserve.worker.runner.kv_cache import allocate_kv_cache, bytes_per_block, copy_blocks
from cbserve.worker.sampling.sampler import Sampler, step_seed
from cbserve.worker.sampling.spec_verify import draw_one
from cbserve.worker.shapes import head_dim_of, num_kv_heads_of

_DRAFT_SEED_SALT = 0x5EED5  # draft draws use their own stream, apart from the target's (seed, position)


@dataclass
class Proposal:
    num_tokens: int  # the request's token count when proposed (the drafts follow its last token)
    drafts: list[int]
    q: torch.Tensor | None  # [len(drafts), vocab]: the draft's distributions (random requests), else None


def _tokenizer_vocab(folder: Path) -> dict[str, int] | None:
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    vocab = json.loads(path.read_text()).get("model", {}).get("vocab")
    return vocab if isinstance(vocab, dict) else None


def check_same_vocab(target: Path, target_vocab: int, draft: Path, draft_vocab: int) -> None:
    """ValueError unless the draft's vocabulary is the target's (size, and tokens where both have a tokenizer.json)."""
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_vocab} tokens, {draft}) differs from the "
            f"target's ({target_vocab} tokens): a draft model must share the target's tokenizer"
        )
    tv, dv = _tokenizer_vocab(target), _tokenizer_vocab(draft)
    if tv is not None and dv is not None and tv != dv:
        raise ValueError(
            f"speculative_config: the draft model's tokenizer ({draft}) maps tokens differently from the "
            "target's: a draft model must share the target's tokenizer"
        )


class DraftModel:
    """The draft model of one worker (tensor_parallel_size 1)."""

    def __init__(
        self,
        config: ModelConfig,
        target_folder: Path,
        target_vocab: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        if config.draft_model is None:
            raise ValueError("ModelConfig.draft_model is not set")
        if config.tensor_parallel_size != 1:
            raise ValueError("speculative_config: a draft model runs only with tensor_parallel_size 1")
        self.k = config.num_speculative_tokens
        self.kv_fp8 = config.kv_fp8  # the draft's cache in the target's KV dtype (its weights: build_model)
        self.folder = resolve_model(config.draft_model).folder
        hf = load_hf_config(self.folder)
        check_same_vocab(target_folder, target_vocab, self.folder, int(hf.vocab_size))
        self.device, self.dtype = config.resolved_device(), config.resolved_dtype()
        own_max = int(getattr(hf, "max_position_embeddings", 0) or 1 << 30)
        self.max_len = min(max_model_len + self.k + 1, own_max)
        built = build_model(self.folder, hf, config, self.device, self.dtype, self.max_len, progress=False)
        self.model, self.dtype = built.model, built.dtype
        # the draft's own attention plans (its heads, its scratch buffer), one a forward pass
        self.attention_builder: AttentionMetadataBuilder = self.model.attention_backend.make_builder(
            self.model.attention_layout)
        self.num_layers = int(hf.num_hidden_layers)
        self.num_kv_heads, self.head_dim = num_kv_heads_of(hf), head_dim_of(hf)
        self.block_size = block_size
        self.scratch_per_row = self.k // block_size + 2
        self.max_num_seqs = max_num_seqs
        self.num_blocks = 0
        self.kv_caches: list[KVCache] = []
        self.proposals: dict[str, Proposal] = {}

    def block_bytes(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                               self.kv_fp8)

    def init_kv_cache(self, num_blocks: int) -> None:
        """The target's ``num_blocks`` mirrored, plus the proposal rows' scratch blocks after them."""
        self.num_blocks = num_blocks
        total = num_blocks + self.max_num_seqs * self.scratch_per_row
        self.kv_caches = allocate_kv_cache(self.num_layers, total, self.block_size, self.num_kv_heads, self.head_dim,
                                           self.dtype, self.device, self.kv_fp8)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_blocks(self.kv_caches, copies)

    def drop(self, req_ids: Any) -> None:
        for r in req_ids:
            self.proposals.pop(r, None)

    def _hidden(self, batch: PreparedBatch) -> torch.Tensor:
        md = batch.metadata
        md.prepared = self.attention_builder.build(md)  # the draft's own plan (the target's pass is done)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, md)

    def run(self, batch: PreparedBatch) -> None:
        """The target's batch through the draft: its cache gets the same positions."""
        self._hidden(batch)

    def q_for(self, state: CachedRequestState, drafts: list[int]) -> torch.Tensor | None:
        """The draft's distributions for ``drafts`` of ``state`` (scheduled as proposed), else None."""
        p = self.proposals.get(state.req_id)
        if p is None or p.q is None or p.num_tokens != len(state.token_ids) or p.drafts[: len(drafts)] != drafts:
            return None
        return p.q[: len(drafts)]

    def propose(self, states: list[CachedRequestState], sampler: Sampler) -> dict[str, list[int]]:
        """``k`` draft tokens for each of ``states`` (the requests that just sampled), by ``k`` draft steps."""
        rows = [
            s
            for s in states
            if s.num_samples == 1
            and not s.sampling_params.use_beam_search
            and s.sampling_params.structured is None
            and len(s.token_ids) + self.k <= self.max_len
        ]
        for s in states:
            self.proposals.pop(s.req_id, None)
        if not rows or self.k < 1:
            return {}
        drafts: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        for _ in range(self.k):
            views = [self._view(i, s, drafts[i]) for i, s in enumerate(rows)]
            batch = build_batch(views, {v.req_id: 1 for v in views}, self.block_size, self.device)
            hidden = self._hidden(batch)
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_rows))
            self._draw(sampler, logits, batch, drafts, qs)
        out: dict[str, list[int]] = {}
        for s, d, q in zip(rows, drafts, qs, strict=True):
            self.proposals[s.req_id] = Proposal(len(s.token_ids), d, torch.stack(q) if q else None)
            out[s.req_id] = d
        return out

    def _view(self, i: int, s: CachedRequestState, drafts: list[int]) -> CachedRequestState:
        """Request ``s`` with its drafts so far, one token to compute (the last), its table extended by
        scratch blocks where its allocated ones end."""
        tokens = s.token_ids + drafts
        need = -(-len(tokens) // self.block_size)
        first = self.num_blocks + i * self.scratch_per_row
        blocks = s.block_ids[:need] + list(range(first, first + max(0, need - len(s.block_ids))))
        return CachedRequestState(
            s.req_id, tokens, s.num_prompt_tokens, s.sampling_params, blocks, len(tokens) - 1, 1, s.seed
        )

    def _draw(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        batch: PreparedBatch,
        drafts: list[list[int]],
        qs: list[list[torch.Tensor]],
    ) -> None:
        rows = batch.sample_rows
        processed = sampler.process(logits.float(), rows)
        greedy = processed.argmax(dim=-1).tolist()
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        probs = sampler.probs(processed[rand], [rows[i] for i in rand]) if rand else None
        for i, row in enumerate(rows):
            if row.params.greedy or probs is None:
                drafts[i].append(greedy[i])
                continue
            q = probs[rand.index(i)]
            q = q / q.sum()
            gen = None
            if row.seed is not None:
                gen = torch.Generator(device=q.device)
                gen.manual_seed(step_seed(row.seed ^ _DRAFT_SEED_SALT, len(row.token_ids)))
            drafts[i].append(draw_one(q, gen))
            qs[i].append(q)
