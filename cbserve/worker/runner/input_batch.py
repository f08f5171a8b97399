"""Per-request state kept by the model runner, and the flattened batch built from it each iteration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from cbserve.scheduler.outputs import CachedRequestData, NewRequestData
from cbserve.worker.attention.backend import AttentionMetadata
from cbserve.worker.runner.block_table import BlockTable
from cbserve.worker.runner.step_buffers import StepBuffers
from cbserve.worker.sampling.sampler import SamplingRow
from cbserve.worker.sampling.spec_verify import DraftGroup


@dataclass(slots=True)
class CachedRequestState(NewRequestData):
    """The worker's state of one request: what its ``NewRequestData`` said (its own copies of the lists), kept up
    to date by the steps' ``CachedRequestData`` and the samples the worker keeps."""

    pooled: torch.Tensor | None = None  # pooling runner: what the prompt's chunks so far pooled to (pooler.py)
    _row: SamplingRow | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_new(cls, d: NewRequestData) -> CachedRequestState:
        return cls(d.req_id, list(d.token_ids), d.num_prompt_tokens, d.sampling_params, list(d.block_ids),
                   d.num_computed_tokens, d.num_samples, d.seed, d.lora)

    def sample_row(self) -> SamplingRow:
        """The row this sequence samples with (its seed unshifted): the same object every step, as it holds
        ``token_ids``, which grows in place."""
        if self._row is None:
            self._row = SamplingRow(self.sampling_params, self.token_ids, self.num_prompt_tokens, self.seed)
        return self._row

    def update(self, d: CachedRequestData) -> None:
        self.token_ids.extend(d.new_token_ids)
        self.block_ids.extend(d.new_block_ids)
        self.num_computed_tokens = d.num_computed_tokens


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_rows: torch.Tensor  # rows of the flattened batch whose logits are needed (one per sample row)
    sampled_req_ids: list[str] = field(default_factory=list)
    # One entry per sampled sequence row: index into sampled_req_ids, and the row itself. Without drafts,
    # sample row j reads logits row ``sample_owner[j]``; with drafts (``draft_groups``), row j reads j.
    sample_owner: list[int] = field(default_factory=list)
    sample_rows: list[SamplingRow] = field(default_factory=list)
    # Prompt logprobs: per request asking for them, the prompt positions computed this step.
    prompt_lp: list[PromptLogprobRows] = field(default_factory=list)
    draft_groups: list[DraftGroup] = field(default_factory=list)


@dataclass(frozen=True)
class PromptLogprobRows:
    """Rows ``first_row ..`` of the flattened batch hold prompt positions ``start ..`` of ``req_id``; the
    logits at position p score prompt token p + 1 (``targets``), with ``num_top`` alternatives."""

    req_id: str
    start: int
    first_row: int
    targets: list[int]
    num_top: int


def prompt_logprob_rows(s: CachedRequestState, start: int, end: int, first_row: int) -> PromptLogprobRows | None:
    """The prompt positions in [start, end) whose next token is a prompt token, for a request that asked
    for prompt logprobs (None when there are none this step)."""
    k = s.sampling_params.prompt_logprobs
    stop = min(end, s.num_prompt_tokens - 1)
    if k is None or start >= stop:
        return None
    return PromptLogprobRows(s.req_id, start, first_row, s.token_ids[start + 1 : stop + 1], k)


def order_decode_first(states: list[CachedRequestState], num_scheduled: Mapping[str, int],
                       by_adapter: bool = False) -> list[CachedRequestState]:
    """One-token requests first; ``by_adapter``: each part ordered by LoRA adapter (the base model first), so
    an adapter's tokens form at most two runs of the batch (lora.py)."""
    decodes = [s for s in states if num_scheduled[s.req_id] == 1]
    prefills = [s for s in states if num_scheduled[s.req_id] != 1]
    if by_adapter:
        decodes.sort(key=_adapter_id)
        prefills.sort(key=_adapter_id)
    return decodes + prefills


def _adapter_id(state: CachedRequestState) -> int:
    return 0 if state.lora is None else state.lora.lora_int_id


@dataclass
class SampleRows:
    """The rows to sample, collected while a batch is flattened."""

    req_ids: list[str] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    rows: list[SamplingRow] = field(default_factory=list)
    groups: list[DraftGroup] = field(default_factory=list)
    one_to_one: bool = False  # a logits row per sample row (a batch with drafts)

    def add_drafts(self, s: CachedRequestState, last_row: int, drafts: list[int]) -> None:
        """A request with drafts: one logits and sample row per draft position plus one (row j's history
        holds the drafts before it). Only in batches built with ``spec``: their logits rows map 1:1."""
        owner = len(self.req_ids)
        self.req_ids.append(s.req_id)
        self.groups.append(DraftGroup(owner, len(self.rows), list(drafts)))
        k = len(drafts)
        for j in range(k + 1):
            self.logits_rows.append(last_row - k + j)
            self.owner.append(owner)
            self.rows.append(SamplingRow(s.sampling_params, s.token_ids + drafts[:j], s.num_prompt_tokens, s.seed))

    def add(self, s: CachedRequestState, row: int) -> None:
        owner = len(self.req_ids)
        self.req_ids.append(s.req_id)
        self.logits_rows.append(row)
        # n > 1: the row that completes the prompt is sampled num_samples times (sample i with seed + i).
        k = s.num_samples if len(s.token_ids) == s.num_prompt_tokens else 1
        for i in range(k):
            seed = None if s.seed is None else s.seed + i
            self.owner.append(owner)
            self.rows.append(s.sample_row() if i == 0 else
                             SamplingRow(s.sampling_params, s.token_ids, s.num_prompt_tokens, seed))
            if self.one_to_one and i:
                self.logits_rows.append(row)


@dataclass
class _Plan:
    """What the pass over a step's requests gathers: the token ids, and per request its table row, first
    position and number of query tokens; the sample rows and prompt-logprob rows. ``head``: the rows and
    first positions of the leading run of plain one-token requests, as arrays (``rows`` and ``starts``
    hold the rest)."""

    samples: SampleRows
    ids: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    prompt_lp: list[PromptLogprobRows] = field(default_factory=list)
    num_decodes: int = 0  # the leading run of one-token requests
    head: tuple[np.ndarray, np.ndarray] | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Table rows, first positions and query lengths of all requests."""
        if self.head is not None and not self.rows:  # all plain one-token requests
            return self.head[0], self.head[1], np.ones(len(self.head[0]), dtype=np.int64)
        q = np.array(self.query_lens, dtype=np.int64)
        rows, starts = np.array(self.rows, dtype=np.int64), np.array(self.starts, dtype=np.int64)
        if self.head is None:
            return rows, starts, q
        return np.concatenate([self.head[0], rows]), np.concatenate([self.head[1], starts]), q


def _refuse(s: CachedRequestState, n: int, num_tokens: int, has_drafts: bool, block_size: int) -> None:
    """``n`` tokens from ``s.num_computed_tokens`` must be known (drafts: end exactly at the last draft)
    and have KV slots."""
    end = s.num_computed_tokens + n
    if n < 1 or end > num_tokens or (has_drafts and end != num_tokens):
        raise ValueError(
            f"request {s.req_id}: {n} tokens scheduled from {s.num_computed_tokens}, {num_tokens} known"
        )
    raise ValueError(f"request {s.req_id}: {end} tokens but only {len(s.block_ids)} blocks")


def _plan(states: list[CachedRequestState], num_scheduled: Mapping[str, int], block_size: int,
          spec: Mapping[str, list[int]] | None, table: BlockTable) -> _Plan:
    """The per-request pass: only what cannot be done over all tokens at once (see ``build_batch``). The
    leading run of plain one-token requests, the common case, is gathered list by list."""
    p = _Plan(SampleRows(one_to_one=bool(spec)))
    rids = [s.req_id for s in states]
    q = list(map(num_scheduled.__getitem__, rids))
    d = len(q) if q.count(1) == len(q) else next(i for i, n in enumerate(q) if n != 1)
    if d and not _plain_decodes(states[:d], rids[:d], spec, table, block_size, p):
        d = 0
    _general(states[d:], q[d:], block_size, spec, table.row_of, p)
    return p


def _plain_decodes(states: list[CachedRequestState], rids: list[str], spec: Mapping[str, list[int]] | None,
                   table: BlockTable, block_size: int, p: _Plan) -> bool:
    """Gather one-token requests into the empty ``p``, when each computes its last known token (so it samples
    one row and, being past its prompt, has no prompt logprobs), has its block and no drafts or fork point;
    else False with ``p`` untouched."""
    tokens = [s.token_ids for s in states]
    lens = np.array(list(map(len, tokens)), dtype=np.int64)
    starts = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
    rows = np.array(list(map(table.row_of.__getitem__, rids)), dtype=np.int64)
    if not ((lens == starts + 1).all() and (table.lens[rows] * block_size >= lens).all()):
        return False
    if any(len(s.token_ids) == s.num_prompt_tokens for s in states if s.num_samples != 1):  # a fork point
        return False
    if spec and any(map(spec.get, rids)):
        return False
    n = len(states)
    p.ids, p.head, p.query_lens, p.num_decodes = [t[-1] for t in tokens], (rows, starts), [1] * n, n
    p.samples.req_ids, p.samples.logits_rows, p.samples.owner = rids, list(range(n)), list(range(n))
    p.samples.rows = [s._row or s.sample_row() for s in states]
    return True


def _general(states: list[CachedRequestState], q: list[int], block_size: int,
             spec: Mapping[str, list[int]] | None, row_of: Mapping[str, int], p: _Plan) -> None:
    """Any request, one by one, appended to ``p``."""
    ids, samples = p.ids, p.samples
    for s, n in zip(states, q, strict=True):
        rid, tokens, start = s.req_id, s.token_ids, s.num_computed_tokens
        end, known = start + n, len(tokens)
        drafts = spec.get(rid) if spec else None
        total = known + len(drafts) if drafts else known
        if n < 1 or end > total or (drafts and end != total) or end > len(s.block_ids) * block_size:
            _refuse(s, n, total, bool(drafts), block_size)
        if n == 1 and p.num_decodes == len(p.query_lens):
            p.num_decodes += 1
        if s.sampling_params.prompt_logprobs is not None:
            lp_rows = prompt_logprob_rows(s, start, end, len(ids))
            if lp_rows is not None:
                p.prompt_lp.append(lp_rows)
        if n == 1 and end <= known:
            ids.append(tokens[start])
        else:
            ids.extend(tokens[start : min(end, known)])
            if drafts:
                ids.extend(drafts[max(0, start - known) : end - known])
        p.rows.append(row_of[rid])
        p.starts.append(start)
        p.query_lens.append(n)
        if drafts:
            samples.add_drafts(s, len(ids) - 1, drafts)
        elif end == known:
            samples.add(s, len(ids) - 1)


def build_batch(
    states: list[CachedRequestState],
    num_scheduled: Mapping[str, int],
    block_size: int,
    device: torch.device,
    spec: Mapping[str, list[int]] | None = None,
    table: BlockTable | None = None,
    buffers: StepBuffers | None = None,
) -> PreparedBatch:
    """Flatten the scheduled tokens of ``states`` (already ordered decode-first) into one batch; ``spec``:
    draft tokens by request id, computed after its known tokens.

    ``table``: the runner's persistent block tables, holding a row for each of ``states`` (None: a table of
    their ``block_ids`` is made for this batch). ``buffers``: the runner's host buffer the inputs are staged
    in (None: a fresh, unpinned one). One pass over the requests collects what needs them one by one (token
    ids, sample rows); positions, slots, lengths and the padded block tables are computed over all tokens at
    once, and every input reaches the device in one copy."""
    if table is None:
        table = BlockTable.of([(s.req_id, s.block_ids) for s in states])
    p = _plan(states, num_scheduled, block_size, spec, table)
    rows, starts, q = p.arrays()
    seq_lens = starts + q
    if len(p.ids) == len(q):  # one token per request
        tok_rows, pos, cu = rows, starts, np.arange(len(q) + 1, dtype=np.int64)
    else:
        cu = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        owner = np.repeat(np.arange(len(q)), q)
        tok_rows, pos = rows[owner], np.arange(len(p.ids)) - cu[owner] + starts[owner]
    slots = table.blocks[tok_rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
    tables = table.gather(rows, int(table.lens[rows].max()))
    ids, positions, slot_mapping, block_tables, seq_lens_t, query_start_loc, logits_rows = (
        buffers or StepBuffers(device, pin=False)  # a caller without buffers: plain synchronous copies
    ).stage([
        np.array(p.ids, dtype=np.int64), pos, slots, tables, seq_lens.astype(np.int32), cu.astype(np.int32),
        np.array(p.samples.logits_rows, dtype=np.int64),
    ])
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens_t,
        query_start_loc=query_start_loc, num_decodes=p.num_decodes, max_query_len=max(p.query_lens),
        max_seq_len=int(seq_lens.max()), block_size=block_size, query_lens_cpu=p.query_lens,
        seq_lens_cpu=seq_lens.tolist(),
    )
    return PreparedBatch(
        input_ids=ids, positions=positions, metadata=metadata, logits_rows=logits_rows,
        sampled_req_ids=p.samples.req_ids, sample_owner=p.samples.owner, sample_rows=p.samples.rows,
        prompt_lp=p.prompt_lp, draft_groups=p.samples.groups,
    )
