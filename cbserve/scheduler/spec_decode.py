"""Speculative decoding proposals: n-gram prompt lookup, and a draft model's (standard library only).

The scheduler decides: it owns every sequence's token ids and must know how many draft tokens a sequence
gets before it reserves their KV slots and budget. N-gram drafts are looked up here, at no extra hop. A
draft model runs on the worker (worker/runner/draft_model.py): after sampling it proposes each sequence's next
drafts and returns them with the step's output (``ModelRunnerOutput.draft_token_ids`` ->
``Sequence.drafts``); ``WorkerProposer`` hands them out the next step, cut to the room left. The worker
verifies the drafts in the step's one forward pass (worker/sampling/spec_verify.py) and returns the accepted tokens
plus one; the engine rolls the rest back (``rollback``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cbserve.scheduler.config import SpeculativeConfig
from cbserve.scheduler.kv.kv_cache_manager import KVCacheManager
from cbserve.scheduler.requests.sequence import Sequence


class NgramProposer:
    """Prompt lookup: find the longest suffix of the tokens (``prompt_lookup_min``..``prompt_lookup_max``
    tokens) that occurred earlier in them (most recent occurrence on ties) and propose the tokens that
    followed that occurrence, at most ``num_speculative_tokens``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose(self, tokens: Seq[int], max_drafts: int | None = None) -> list[int]:
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        n_tokens = len(tokens)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        last = tokens[-1]
        max_n = min(self.max_n, n_tokens - 1)
        best_len, best_end = 0, -1
        # candidate ends: earlier positions holding the last token, most recent first
        for end in reversed([i for i, t in enumerate(tokens, 0) if t == last and i < n_tokens - 1]):
            m = 1
            while m < max_n and end - m >= 0 and tokens[end - m] == tokens[n_tokens - 1 - m]:
                m += 1
            if m > best_len:
                best_len, best_end = m, end
                if m == max_n:
                    break
        if best_len < self.min_n:
            return []
        return list(tokens[best_end + 1 : best_end + 1 + k])


    def propose_for(self, seq: Sequence, max_drafts: int) -> list[int]:
        return self.propose(seq.token_ids, max_drafts)


class WorkerProposer:
    """Draft-model proposals: the ones the worker returned for ``seq`` after its last sample, used once."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose_for(self, seq: Sequence, max_drafts: int) -> list[int]:
        drafts, seq.drafts = seq.drafts, []
        return drafts[: min(self.k, max_drafts)]


Proposer = NgramProposer | WorkerProposer


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return WorkerProposer(config) if config.method == "draft_model" else NgramProposer(config)


def drafts_for(proposer: Proposer | None, seq: Sequence, budget: int, num_running: int) -> list[int]:
    """Drafts for a decoding sequence with ``budget`` tokens left in the step: none for fork points, beams
    and structured output (its grammar is applied by the sampler, not by the verification), none while more
    than ``disable_by_batch_size`` sequences run, and never more than its length limit leaves room for
    (drafts + 1 tokens get appended)."""
    group = seq.group
    room = min(budget - 1, group.stop.room(len(seq.token_ids)) - 1)
    if proposer is None or room <= 0 or seq.num_samples != 1 or group.mode == "beam":
        return []
    if group.params.structured is not None:
        return []
    if proposer.disable_by_batch_size is not None and num_running > proposer.disable_by_batch_size:
        return []
    return proposer.propose_for(seq, room)


def rollback(kv: KVCacheManager, seq: Sequence) -> None:
    """After a step that verified ``seq``'s drafts and appended the accepted ones plus one token: all but
    its last token are computed (their full blocks enter the prefix cache: they hold only accepted
    tokens); blocks past the ones its tokens need are freed (only ever rejected drafts' slots: fresh
    blocks, never cached). The worker trims its table the same way (ModelRunner._keep_samples)."""
    seq.num_computed_tokens = len(seq.token_ids) - 1
    if kv.enable_caching and seq.num_computed_tokens // kv.block_size > len(kv.hashes[seq.seq_id]):
        kv.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.group.extra_keys)
    kv.truncate(seq.seq_id, kv.num_required_blocks(len(seq.token_ids)))
    seq.num_sent_blocks = min(seq.num_sent_blocks, len(kv.tables[seq.seq_id]))
