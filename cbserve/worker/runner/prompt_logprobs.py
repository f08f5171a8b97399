"""Prompt logprobs: the log-softmax of the model's logits at prompt positions, scoring each next prompt token
(vLLM's ``prompt_logprobs``, OpenAI's ``echo`` with ``logprobs``). Computed from the hidden states of the
prefill rows of every chunk, a few hundred rows at a time so the [rows, vocab] logits stay small."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cbserve.scheduler.outputs import TokenLogprob
from cbserve.worker.runner.input_batch import PromptLogprobRows

ROWS_PER_CHUNK = 256


def compute_prompt_logprobs(
    hidden: torch.Tensor, requests: Sequence[PromptLogprobRows], logits_fn: Callable[[torch.Tensor], torch.Tensor],
    score: bool = True,
) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """req id -> (first scored prompt position, one TokenLogprob per scored token), from ``hidden`` (the
    batch's final hidden states) through ``logits_fn`` (the model's final norm and LM head). Under tensor
    parallelism every rank must call this (the LM head gathers the vocabulary shards); only the rank with
    ``score`` turns the logits into logprobs (the others get {})."""
    out: dict[str, tuple[int, list[TokenLogprob]]] = {}
    for req in requests:
        entries: list[TokenLogprob] = []
        for lo in range(0, len(req.targets), ROWS_PER_CHUNK):
            targets = req.targets[lo : lo + ROWS_PER_CHUNK]
            rows = hidden[req.first_row + lo : req.first_row + lo + len(targets)]
            logits = logits_fn(rows)
            if score:
                entries.extend(_score(logits, targets, req.num_top))
        if score:
            out[req.req_id] = (req.start + 1, entries)
    return out


def _score(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    lp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)
    tgt_lp = lp.gather(1, tgt)
    ranks = ((lp > tgt_lp).sum(dim=1) + 1).tolist()
    values = tgt_lp.squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if num_top:
        top_vals, top_ids = lp.topk(num_top, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True)]
    return [TokenLogprob(t, v, r, top) for t, v, r, top in zip(targets, values, ranks, tops, strict=True)]
