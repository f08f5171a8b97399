"""Per-request token constraints, applied by the sampler after penalties and min_tokens and before
temperature: ``logit_bias`` (added to the logits), ``allowed_token_ids`` (every other token masked) and
``bad_words_token_ids`` (vLLM's rule: a one-token word is always masked; a longer word's last token is masked
when the sequence's output so far ends with the word's other tokens). Ids outside the vocabulary are
ignored here (the front end refuses them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from cbserve.scheduler.requests.sampling_params import SamplingParams


class ConstrainedRow(Protocol):
    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int


def apply_token_constraints(logits: torch.Tensor, rows: Sequence[ConstrainedRow]) -> torch.Tensor:
    """``logits`` [rows, vocab] with each row's constraints applied (a copy when any row has some)."""
    idx = [i for i, r in enumerate(rows) if r.params.has_token_constraints]
    if not idx:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in idx:
        p, r = rows[i].params, rows[i]
        if p.logit_bias:
            ids = [t for t, _ in p.logit_bias if t < vocab]
            bias = [b for t, b in p.logit_bias if t < vocab]
            if ids:
                logits[i, ids] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = True
            logits[i] = logits[i].masked_fill(~keep, float("-inf"))
        banned = banned_by_bad_words(p.bad_words_token_ids, r.token_ids[r.num_prompt_tokens :])
        banned = [t for t in banned if t < vocab]
        if banned:
            logits[i, banned] = float("-inf")
    return logits


def banned_by_bad_words(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Tokens that would complete one of ``words`` right after ``output`` (the tokens generated so far)."""
    banned = []
    for word in words:
        prefix = list(word[:-1])
        if not prefix or (len(output) >= len(prefix) and list(output[len(output) - len(prefix) :]) == prefix):
            banned.append(word[-1])
    return banned
