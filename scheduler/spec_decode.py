"""Speculative decoding proposals: n-gram prompt lookup (standard library only).

The scheduler proposes: it owns every sequence's token ids and must know how many draft tokens a sequence
gets before it reserves their KV slots and budget, so proposing here costs no extra hop. The worker
verifies the drafts in the step's one forward pass (worker/spec_verify.py) and returns the accepted tokens
plus one; the engine rolls the rest back (``Scheduler.rollback_drafts``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import SpeculativeConfig


class NgramProposer:
    """Prompt lookup: find the longest suffix of the tokens (``prompt_lookup_min``..``prompt_lookup_max``
    tokens) that occurred earlier in them (most recent occurrence on ties) and propose the tokens that
    followed that occurrence, at most ``num_speculative_tokens``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: Sequence[int], max_drafts: int | None = None) -> list[int]:
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
