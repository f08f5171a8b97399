"""One batched sampler over all rows sampled in an iteration.

Per row: penalties (repetition over prompt + output, presence/frequency over output), min_tokens (EOS and
stop ids masked until reached), token constraints (logit_bias, allowed_token_ids, bad words:
``token_constraints.py``), then greedy argmax or temperature / top-k / top-p / min-p sampling by an
exponential race (argmax of p / Exp(1) noise), which lets every seeded row draw its noise from its own
generator. A seeded row's generator is re-seeded from (seed, position) at each step, so its output
depends only on its seed and tokens, never on batch companions, preemption or timing.
Logprobs come from the raw log-softmax of the model's logits (before penalties and temperature).
Structured output: a batch token bitmask (worker/structured.py) masks what each row's grammar forbids,
after penalties, min_tokens and the token constraints, before the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.sampling_params import SamplingParams

from .structured import apply_bitmask
from .token_constraints import apply_token_constraints

if TYPE_CHECKING:
    from .cpu.kernels import CpuKernels

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of logits to sample from and what the sampler needs to know about its sequence."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + generated so far (history for penalties)
    num_prompt_tokens: int
    seed: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def step_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed for (seed, position) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    """``kernels``: the CPU C kernels, when the worker has them (the structured-output mask runs on them)."""

    def __init__(self, eos_token_ids: Sequence[int] = (), kernels: CpuKernels | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.kernels = kernels

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample one token per row of ``logits`` [num_rows, vocab]; returns token ids and logprobs.
        ``bitmask``: the structured-output token bitmask of the rows (None: no row is constrained)."""
        given = logits
        logits = logits.float()
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        logits = self.process(logits, rows)
        if bitmask is not None:  # in place: process() already returned a copy of the given logits
            logits = apply_bitmask(logits, bitmask, logits.data_ptr() != given.data_ptr(), self.kernels)
        tokens = self._pick(logits, rows)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            idx = [i for i, w in enumerate(want_lp) if w]
            for i, lp in zip(idx, _logprobs(raw_logprobs, tokens, idx, rows), strict=True):
                logprobs[i] = lp
        return token_list, logprobs

    # ---- logits processing -------------------------------------------------------------------
    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Float logits after the penalties, min_tokens and the token constraints (logit_bias, allowed and
        banned tokens): what greedy takes the argmax of."""
        logits = self._apply_min_tokens(self._apply_penalties(logits.float(), rows), rows)
        return apply_token_constraints(logits, rows)

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution a random row samples from: ``process``ed logits through temperature, top-k,
        top-p and min-p (rows not renormalised after min-p; the exponential race does not need it)."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=dev)
        logits = logits / temps.unsqueeze(1)
        logits = _top_k(logits, [r.params.top_k for r in rows])
        logits = _top_p(logits, [r.params.top_p for r in rows])
        probs = torch.softmax(logits, dim=-1)
        return _min_p(probs, [r.params.min_p for r in rows])

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if not idx:
            return logits
        logits = logits.clone()
        vocab, dev = logits.shape[1], logits.device
        for i in idx:
            r, p = rows[i], rows[i].params
            row = logits[i]
            out_ids = torch.tensor(list(r.token_ids[r.num_prompt_tokens :]), dtype=torch.long, device=dev)
            counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
            counts.index_add_(0, out_ids.clamp(max=vocab - 1), torch.ones_like(out_ids, dtype=torch.float32))
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt_ids = torch.tensor(
                    list(r.token_ids[: r.num_prompt_tokens]), dtype=torch.long, device=dev
                )
                seen[prompt_ids.clamp(max=vocab - 1)] = True
                penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = torch.where(seen, penalised, row)
            row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
            logits[i] = row
        return logits

    def _apply_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        cloned = False
        for i, r in enumerate(rows):
            p = r.params
            if p.min_tokens == 0 or r.num_output_tokens >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            banned = {t for t in banned if t < logits.shape[1]}
            if not banned:
                continue
            if not cloned:
                logits, cloned = logits.clone(), True
            logits[i, list(banned)] = float("-inf")
        return logits

    # ---- choosing tokens ----------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return logits.argmax(dim=-1)
        tokens = logits.argmax(dim=-1)
        rand = [i for i, g in enumerate(greedy) if not g]
        rand_t = torch.tensor(rand, dtype=torch.long, device=logits.device)
        tokens[rand_t] = self._sample_random(logits[rand_t], [rows[i] for i in rand])
        return tokens

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        dev = logits.device
        probs = self.probs(logits, rows)
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):
            if r.seed is not None:
                gen = torch.Generator(device=dev)
                gen.manual_seed(step_seed(r.seed, len(r.token_ids)))
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return logits
    k_max = max(k for k in ks if k < vocab)
    values = logits.topk(k_max, dim=-1).values  # [rows, k_max] descending
    k_t = torch.tensor([min(k, k_max) - 1 for k in ks], dtype=torch.long, device=logits.device)
    kth = values.gather(1, k_t.unsqueeze(1))
    active = torch.tensor([k < vocab for k in ks], device=logits.device).unsqueeze(1)
    return logits.masked_fill(active & (logits < kth), float("-inf"))


def _top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    p_t = torch.tensor(top_ps, dtype=torch.float32, device=logits.device).unsqueeze(1)
    drop_sorted = before >= p_t  # keep tokens until the kept mass reaches top_p (the first is always kept)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if all(p == 0.0 for p in min_ps):
        return probs
    mp = torch.tensor(min_ps, dtype=torch.float32, device=probs.device).unsqueeze(1)
    threshold = probs.max(dim=-1, keepdim=True).values * mp
    return probs.masked_fill(probs < threshold, 0.0)


def token_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]
) -> list[TokenLogprob]:
    """Logprobs (raw log-softmax ``raw``) of ``tokens[i]`` at the rows ``idx``, with each row's top ones."""
    return _logprobs(raw, tokens, idx, rows)


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]
) -> list[TokenLogprob]:
    idx_t = torch.tensor(idx, dtype=torch.long, device=raw.device)
    lp = raw[idx_t]
    tok = tokens[idx_t]
    tok_lp = lp.gather(1, tok.unsqueeze(1))
    ranks = ((lp > tok_lp).sum(dim=1) + 1).tolist()
    n_top = max(rows[i].params.logprobs or 0 for i in idx)
    top_vals, top_ids = lp.topk(n_top, dim=-1) if n_top else (None, None)
    out = []
    tok_list, tok_lp_list = tok.tolist(), tok_lp.squeeze(1).tolist()
    for j, i in enumerate(idx):
        n = rows[i].params.logprobs or 0
        top = []
        if n:
            top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True))
        out.append(TokenLogprob(tok_list[j], tok_lp_list[j], ranks[j], top))
    return out
