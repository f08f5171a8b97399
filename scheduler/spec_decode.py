"""Speculative decoding proposals: n-gram prompt lookup (standard library only).

The scheduler proposes: it owns every sequence's token ids and must know how many draft tokens a sequence
gets before it reserves their KV slots and budget, so proposing here costs no extra hop. The worker
verifies the drafts in the step's one forward pass (worker/spec_verify.py) and returns the accepted tokens
plus one; the engine rolls the rest back (``rollback``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from .config import SpeculativeConfig
from .kv_cache_manager import KVCacheManager
from .sequence import Sequence


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


def drafts_for(proposer: NgramProposer | None, seq: Sequence, budget: int, num_running: int) -> list[int]:
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
    return proposer.propose(seq.token_ids, room)


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
