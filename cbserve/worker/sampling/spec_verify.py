"""Verification of speculative-decoding drafts, on the logits of one forward pass.

A request with drafts d_0..d_{k-1} has k + 1 logits rows: row j predicts the token after its last token
and d_0..d_{j-1}. Each row is processed exactly as the sampler would (penalties over that row's history,
min_tokens, temperature, top-k/p, min-p), so speculation changes how fast tokens come, not which:

- greedy: the target's argmax at each row; drafts are accepted while they equal it, and the target's own
  token ends the run (at the first mismatch, or the bonus token after k accepted drafts). The output is
  the one greedy decoding without drafts would give.
- temperature > 0: rejection sampling. Draft d, drawn from q, is accepted with probability
  min(1, p(d) / q(d)); on rejection the token is drawn from max(0, p - q) renormalised; after k accepted
  drafts the bonus token is drawn from the last row's p. Every output token is thus distributed as the
  target's p. A draft model's q is its own distribution (draft_model.py); an n-gram draft is
  deterministic (q = one-hot on d): accepted with probability p(d), the residual is p with d removed.

A seeded row draws its uniforms from a CPU generator seeded with (seed, position), like the sampler: the
same seed, prompt and drafts give the same tokens, on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cbserve.scheduler.outputs import TokenLogprob
from cbserve.worker.sampling.sampler import Sampler, SamplingRow, draw, row_generator, token_logprobs


@dataclass(frozen=True)
class DraftGroup:
    """One request's drafts: its rows are ``first_row .. first_row + len(drafts)`` of the logits."""

    owner: int  # index into the batch's sampled requests
    first_row: int
    drafts: list[int]
    q: torch.Tensor | None = None  # [len(drafts), vocab]: the draft model's distributions; None: one-hot

    def with_q(self, q: torch.Tensor | None) -> DraftGroup:
        return DraftGroup(self.owner, self.first_row, self.drafts, q)


def _uniform(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator | None,
             device: torch.device) -> torch.Tensor:
    """Uniforms on ``device``: from ``gen`` (a seeded row's, on the CPU) when given, else the device's default."""
    if gen is None:
        return torch.rand(shape, dtype=dtype, device=device)
    return torch.rand(shape, dtype=dtype, generator=gen, device=gen.device).to(device)


def draw_one(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """A draw from ``probs`` [vocab] (unnormalised is fine), by inverse CDF on one uniform number of ``gen``."""
    u = _uniform((1,), torch.float64, gen, probs.device)
    return int(draw(probs.unsqueeze(0), u)[0])


def accept_random(probs: torch.Tensor, drafts: Sequence[int], gens: Sequence[torch.Generator | None],
                  q: torch.Tensor | None = None) -> list[int]:
    """Rejection sampling of the drafts against the target rows ``probs`` [k + 1, vocab] (each row the
    distribution the sampler draws from, not necessarily normalised; ``gens`` one generator per row);
    ``q`` [k, vocab]: the distributions the drafts were drawn from (normalised), None for deterministic
    drafts. Returns the accepted drafts followed by one token drawn from the target (the residual at a
    rejection, else the bonus)."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        total = float(p.sum())
        gen = gens[j]  # a seeded row's number stays on the host
        u = float(_uniform((), torch.float32, gen, p.device if gen is None else gen.device))
        qd = 1.0 if q is None else float(q[j, draft])
        if total > 0.0 and u * total * qd < float(p[draft]):
            out.append(draft)
            continue
        if q is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p / total - q[j].to(p.dtype)).clamp_min_(0.0) if total > 0.0 else p.clone()
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
                residual = p.clone()
        out.append(draw_one(residual, gens[j]))
        return out
    out.append(draw_one(probs[len(drafts)], gens[len(drafts)]))
    return out


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Drafts while they equal the target's tokens, then the target's token at the first mismatch (or the
    bonus token after the last row)."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        out.append(targets[j])
        if targets[j] != draft:
            return out
    out.append(targets[len(drafts)])
    return out


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow], groups: Sequence[DraftGroup]
) -> list[tuple[list[int], list[TokenLogprob] | None]]:
    """Verify every group's drafts on its rows of ``logits`` (one per sample row in ``rows``); returns, per
    group, the output tokens (accepted drafts + one) and their logprobs when its request asked for them."""
    sel = [g.first_row + j for g in groups for j in range(len(g.drafts) + 1)]
    lg = logits.index_select(0, torch.tensor(sel, dtype=torch.long, device=logits.device)).float()
    srows = [rows[i] for i in sel]
    raw = torch.log_softmax(lg, dim=-1) if any(r.params.logprobs is not None for r in srows) else None
    processed = sampler.process(lg, srows)
    targets = processed.argmax(dim=-1).tolist()
    rand = [i for i, r in enumerate(srows) if not r.params.greedy]
    probs = sampler.probs(processed[rand], [srows[i] for i in rand]) if rand else None
    prob_index = {i: j for j, i in enumerate(rand)}
    results: list[tuple[list[int], list[TokenLogprob] | None]] = []
    base = 0
    chosen = torch.zeros(len(sel), dtype=torch.long)
    for g in groups:
        n = len(g.drafts) + 1
        if srows[base].params.greedy:
            tokens = accept_greedy(targets[base : base + n], g.drafts)
        else:
            if probs is None:
                raise RuntimeError("random rows without probabilities")
            p = probs[[prob_index[base + j] for j in range(n)]]
            gens = [row_generator(srows[base + j], torch.device("cpu")) for j in range(n)]
            tokens = accept_random(p, g.drafts, gens, g.q)
        lps = None
        if raw is not None and srows[base].params.logprobs is not None:
            idx = list(range(base, base + len(tokens)))
            chosen[idx] = torch.tensor(tokens, dtype=torch.long)
            lps = token_logprobs(raw, chosen.to(raw.device), idx, srows)
        results.append((tokens, lps))
        base += n
    return results
