"""The step builder as it was before the persistent block table (main at 782f002, `worker/runner/input_batch.py`):
a Python loop per token and the padded block table rebuilt from lists every step. Kept as the "before" of
bench_step_prep.py and as the reference tests/worker/test_step_prep.py compares the new builder with (the sample
rows are collected by the builder's own ``SampleRows``: that part did not change)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from cbserve.worker.attention.backend import AttentionMetadata
from cbserve.worker.runner.input_batch import (
    CachedRequestState,
    PreparedBatch,
    PromptLogprobRows,
    SampleRows,
    prompt_logprob_rows,
)


def _check_scheduled(s: CachedRequestState, n: int, num_tokens: int, has_drafts: bool, block_size: int) -> None:
    """``n`` tokens from ``s.num_computed_tokens`` must be known (drafts: end exactly at the last draft)
    and have KV slots."""
    end = s.num_computed_tokens + n
    if n < 1 or end > num_tokens or (has_drafts and end != num_tokens):
        raise ValueError(
            f"request {s.req_id}: {n} tokens scheduled from {s.num_computed_tokens}, {num_tokens} known"
        )
    if end > len(s.block_ids) * block_size:
        raise ValueError(f"request {s.req_id}: {end} tokens but only {len(s.block_ids)} blocks")


def reference_build_batch(
    states: list[CachedRequestState],
    num_scheduled: Mapping[str, int],
    block_size: int,
    device: torch.device,
    spec: Mapping[str, list[int]] | None = None,
) -> PreparedBatch:
    """Flatten the scheduled tokens of ``states`` (already ordered decode-first) into one batch; ``spec``:
    draft tokens by request id, computed after its known tokens."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    samples = SampleRows(one_to_one=bool(spec))
    prompt_lp: list[PromptLogprobRows] = []
    num_decodes = 0
    for s in states:
        n = num_scheduled[s.req_id]
        start, end = s.num_computed_tokens, s.num_computed_tokens + n
        drafts = spec.get(s.req_id) if spec else None
        tokens = s.token_ids + drafts if drafts else s.token_ids
        _check_scheduled(s, n, len(tokens), bool(drafts), block_size)
        if n == 1 and num_decodes == len(query_lens):  # leading run of one-token requests
            num_decodes += 1
        lp_rows = prompt_logprob_rows(s, start, end, len(ids))
        if lp_rows is not None:
            prompt_lp.append(lp_rows)
        ids.extend(tokens[start:end])
        pos.extend(range(start, end))
        blocks = s.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_lens.append(n)
        seq_lens.append(end)
        if drafts:
            samples.add_drafts(s, len(ids) - 1, drafts)
        elif end == len(s.token_ids):
            samples.add(s, len(ids) - 1)
    metadata = _metadata(states, slots, query_lens, seq_lens, num_decodes, block_size, device)
    return PreparedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        metadata=metadata,
        logits_rows=torch.tensor(samples.logits_rows, dtype=torch.long, device=device),
        sampled_req_ids=samples.req_ids,
        sample_owner=samples.owner,
        sample_rows=samples.rows,
        prompt_lp=prompt_lp,
        draft_groups=samples.groups,
    )


def _metadata(
    states: list[CachedRequestState], slots: list[int], query_lens: list[int], seq_lens: list[int], num_decodes: int,
    block_size: int, device: torch.device,
) -> AttentionMetadata:
    max_blocks = max(len(s.block_ids) for s in states)
    table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in states]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(table, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
