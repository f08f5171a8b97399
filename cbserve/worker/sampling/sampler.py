"""One batched sampler over all rows sampled in an iteration.

Per row: penalties (repetition over prompt + output, presence/frequency over output), min_tokens (EOS and
stop ids masked until reached), token constraints (logit_bias, allowed_token_ids, bad words:
``token_constraints.py``), then greedy argmax or temperature / top-k / top-p / min-p sampling by inverse
CDF (``draw``: one uniform number per row against the row's cumulative mass), which lets every seeded row
draw its number from its own generator. A seeded row's generator is re-seeded from (seed, position) at each
step, so its output depends only on its seed and tokens, never on batch companions, preemption or timing.
(An exponential race, argmax of p / Exp(1) noise, draws the same distribution but needs a random number per
vocabulary entry: torch's exponential_ took 62 ms for 64 rows of SmolLM2's 49,152, ~40% of a decode step;
the cumulative sums take ~2 ms.)
Logprobs come from the raw log-softmax of the model's logits (before penalties and temperature).
Structured output: a batch token bitmask (worker/sampling/structured.py) masks what each row's grammar forbids,
after penalties, min_tokens and the token constraints, before the choice.

Host synchronisation: ``sample`` runs on the logits' device without reading anything back (per-row settings
go over in non-blocking copies from pinned memory, seeded rows' uniforms are drawn on the host), and
``__call__`` copies its packed result (ids, and the logprobs when asked) to the host once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.requests.sampling_params import SamplingParams
from cbserve.worker.sampling.structured import apply_bitmask
from cbserve.worker.sampling.token_constraints import apply_token_constraints

if TYPE_CHECKING:
    from cbserve.worker.cpu.kernels import CpuKernels

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
        ``bitmask``: the structured-output token bitmask of the rows (None: no row is constrained).
        One device-to-host copy: ``sample``'s packed result."""
        return unpack_samples(self.sample(logits, rows, bitmask).tolist(), rows)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``__call__`` on the logits' device, with no host synchronisation: the tokens [rows] (int64) when
        no row asks for logprobs, else tokens and logprobs packed as ``pack_samples`` describes."""
        given = logits
        logits = logits.float()
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if lp_rows else None
        logits = self.process(logits, rows)
        if bitmask is not None:  # in place: process() already returned a copy of the given logits
            logits = apply_bitmask(logits, bitmask, logits.data_ptr() != given.data_ptr(), self.kernels)
        tokens = self._pick(logits, rows)
        if raw_logprobs is None:
            return tokens
        return pack_samples(raw_logprobs, tokens, lp_rows, rows)

    # ---- logits processing -------------------------------------------------------------------
    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Float logits after the penalties, min_tokens and the token constraints (logit_bias, allowed and
        banned tokens): what greedy takes the argmax of."""
        logits = self._apply_min_tokens(self._apply_penalties(logits.float(), rows), rows)
        return apply_token_constraints(logits, rows)

    def probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution a random row samples from: ``process``ed logits through temperature, top-k,
        top-p and min-p (rows not renormalised after min-p; ``draw`` does not need it)."""
        temps = to_device([r.params.temperature for r in rows], torch.float32, logits.device)
        logits = logits / temps.unsqueeze(1)
        logits = _top_k(logits, [r.params.top_k for r in rows])
        logits = _top_p(logits, [r.params.top_p for r in rows], self.kernels)
        probs = torch.softmax(logits, dim=-1)
        return _min_p(probs, [r.params.min_p for r in rows])

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Repetition (prompt + output), frequency and presence (output) penalties, on the (row, token)
        entries they touch only: the distinct ids of each penalised row's history, in one batched gather /
        scatter (a pass over whole rows cost 10-24 ms a step at 64 rows of 49,152 tokens). The (row, token)
        pairs and their counts are found on the host and go over in one copy."""
        idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if not idx:
            return logits
        dev, vocab = logits.device, logits.shape[1]
        out_keys, out_counts = torch.unique(
            _keys(idx, [rows[i].token_ids[rows[i].num_prompt_tokens :] for i in idx], vocab), return_counts=True
        )
        rep_rows = [i for i in idx if rows[i].params.repetition_penalty != 1.0]
        prompt_keys = _keys(rep_rows, [rows[i].token_ids[: rows[i].num_prompt_tokens] for i in rep_rows], vocab)
        keys = torch.unique(torch.cat([out_keys, prompt_keys]))  # sorted: every (row, token) seen
        counts = torch.zeros(keys.shape[0], dtype=torch.long)
        counts[torch.searchsorted(keys, out_keys)] = out_counts
        packed = to_device(torch.stack([keys // vocab, keys % vocab, counts]), torch.long, dev)
        row, tok, counts_f = packed[0], packed[1], packed[2].float()
        params = to_device([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                            for r in rows], torch.float32, dev)[row]
        rep, freq, pres = params[:, 0], params[:, 1], params[:, 2]
        vals = logits[row, tok]
        vals = torch.where(rep != 1.0, torch.where(vals > 0, vals / rep, vals * rep), vals)
        out = logits.clone()
        out[row, tok] = vals - freq * counts_f - pres * (counts_f > 0).float()
        return out

    def _apply_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """EOS and the stop ids at -inf in the rows short of their min_tokens (one copy of their places)."""
        places: list[tuple[int, int]] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.min_tokens == 0 or r.num_output_tokens >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            places += [(i, t) for t in sorted(banned) if t < logits.shape[1]]
        if not places:
            return logits
        where = to_device(places, torch.long, logits.device)
        return logits.index_put((where[:, 0], where[:, 1]), logits.new_full((), float("-inf")))

    # ---- choosing tokens ----------------------------------------------------------------------
    def _pick(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            return greedy_tokens(logits, self.kernels)
        if not any(greedy):
            return self._sample_random(logits, rows)
        tokens = greedy_tokens(logits, self.kernels)
        rand = [i for i, g in enumerate(greedy) if not g]
        rand_t = to_device(rand, torch.long, logits.device)
        return tokens.index_copy_(0, rand_t, self._sample_random(logits.index_select(0, rand_t),
                                                                 [rows[i] for i in rand]))

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        return draw(self.probs(logits, rows), row_uniforms(rows, logits.device))


def to_device(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (host numbers, nested lists or a CPU tensor) as a ``dtype`` tensor on ``device`` with no host
    synchronisation: on CUDA from pinned memory in a non-blocking copy (a pageable copy waits for the stream)."""
    pin = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        on_host = values.to(dtype).pin_memory() if pin else values.to(dtype)
    else:
        on_host = torch.tensor(values, dtype=dtype, pin_memory=pin)
    return on_host.to(device, non_blocking=pin)


def row_generator(row: SamplingRow, device: torch.device) -> torch.Generator | None:
    """A seeded row's generator for this step, seeded from (seed, position); None for an unseeded row."""
    if row.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(step_seed(row.seed, len(row.token_ids)))
    return gen


def row_uniforms(rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per row (float64): the unseeded rows' from torch's default generator of
    ``device``; a seeded row's from a CPU generator seeded from (seed, position) (``row_generator``'s first
    number), drawn on the host and copied over with the others in one copy: the same on every device."""
    u = torch.rand(len(rows), dtype=torch.float64, device=device)
    seeded = [i for i, r in enumerate(rows) if r.seed is not None]
    if not seeded:
        return u
    host = torch.full((len(rows),), float("nan"), dtype=torch.float64)
    gen = torch.Generator()
    for i in seeded:
        gen.manual_seed(step_seed(rows[i].seed, len(rows[i].token_ids)))  # type: ignore[arg-type]
        host[i : i + 1].uniform_(generator=gen)
    if len(seeded) == len(rows):
        return to_device(host, torch.float64, device)
    mixed = to_device(host, torch.float64, device)
    return torch.where(mixed.isnan(), u, mixed)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [rows, vocab] (non-negative, unnormalised is fine) by inverse CDF: the
    first token whose cumulative mass (float64) exceeds ``uniforms`` [rows] (in [0, 1)) times the row's total,
    which is always a token of positive mass: torch's float64 uniforms are at most 1 - 2^-53, and that times
    any total rounds to below the total. (A uniform of 1, outside that range, takes the last token of
    positive mass; the clamp only keeps a NaN row's index in range.) No host synchronisation."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniforms.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    target = torch.minimum(target, cdf[:, -1:].nextafter(cdf.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _keys(rows: Sequence[int], ids: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """row * vocab + token for every id of every row (ids >= vocab taken as the last token: the model
    cannot have produced them), as one int64 tensor on the CPU."""
    parts = [
        torch.tensor(list(t), dtype=torch.long).clamp_(max=vocab - 1) + r * vocab
        for r, t in zip(rows, ids, strict=True)
        if len(t)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return logits
    k_max = max(k for k in ks if k < vocab)
    values = logits.topk(k_max, dim=-1).values  # [rows, k_max] descending
    k_t = to_device([k - 1 if k < vocab else -1 for k in ks], torch.long, logits.device).unsqueeze(1)
    kth = values.gather(1, k_t.clamp(min=0))
    return logits.masked_fill((k_t >= 0) & (logits < kth), float("-inf"))


def _top_p(logits: torch.Tensor, top_ps: list[float], kernels: CpuKernels | None = None) -> torch.Tensor:
    """Keep each row's nucleus: its most likely tokens until their mass reaches top_p (the first always kept),
    every token as likely as the last one kept included. On CPU with the C kernels the cut comes from one
    pass of float-bit buckets and a quickselect in the bucket where the nucleus ends
    (``cb_top_p_threshold_f32``: linear in the vocabulary whatever the nucleus); on CPU without them it is
    searched in the row's k most likely tokens, k = 64, 512, 4096, then the whole row, so a full sort (117 ms
    for 64 rows of SmolLM2's 49,152 tokens on CPU) is paid only where a nucleus spreads past 4,096 tokens;
    on an accelerator from one sort of every row, without a host synchronisation."""
    if all(p >= 1.0 for p in top_ps):
        return logits
    probs = logits.softmax(dim=-1)
    if probs.device.type != "cpu":
        threshold = _top_p_threshold_by_sort(probs, top_ps)
    elif kernels is not None:
        threshold = kernels.top_p_threshold(probs, top_ps)
    else:
        threshold = _top_p_threshold_by_topk(probs, top_ps)
    return torch.where(probs < threshold, float("-inf"), logits)  # one pass (masked_fill copies, then fills)


def _top_p_threshold_by_sort(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """[rows, 1]: each row's least nucleus probability (0: the row kept whole), from a sort of every row."""
    p_t = to_device(top_ps, torch.float32, probs.device).unsqueeze(1)
    top = probs.sort(dim=-1, descending=True).values
    n_kept = ((top.cumsum(dim=-1) - top) < p_t).sum(dim=-1, keepdim=True)  # >= 1: top_p > 0
    return torch.where(p_t < 1.0, top.gather(1, n_kept - 1), 0.0)


def _top_p_threshold_by_topk(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """[rows, 1]: each row's least nucleus probability (0: the row kept whole), from growing top-k's (on the
    CPU: the loop reads which rows are done)."""
    vocab = probs.shape[1]
    p_t = torch.tensor(top_ps, dtype=torch.float32, device=probs.device).unsqueeze(1)
    threshold = torch.zeros_like(p_t)
    todo = torch.nonzero(p_t.squeeze(1) < 1.0).squeeze(1)
    k = 64
    while todo.numel():
        k = min(k, vocab)
        rows = probs if todo.numel() == probs.shape[0] else probs[todo]  # no copy in the first round
        top = rows.topk(k, dim=-1).values  # descending
        before = top.cumsum(dim=-1) - top  # mass strictly above each token
        kept = before < p_t[todo]  # the first token is always kept (before = 0)
        found = (~kept).any(dim=-1) | (k == vocab)
        n_kept = kept.sum(dim=-1, keepdim=True)
        threshold[todo[found]] = top[found].gather(1, n_kept[found] - 1)
        todo = todo[~found]
        k *= 8
    return threshold


def _min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if all(p == 0.0 for p in min_ps):
        return probs
    mp = to_device(min_ps, torch.float32, probs.device).unsqueeze(1)
    threshold = probs.max(dim=-1, keepdim=True).values * mp
    return probs.masked_fill(probs < threshold, 0.0)


# ---- logprobs: packed with the tokens, read back in one copy -----------------------------------
def pack_samples(raw: torch.Tensor, tokens: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One float64 vector: ``tokens`` [R], then ``logprob_block`` of the rows ``idx`` (ids, ranks and
    logprobs are exact in float64). ``unpack_samples`` reads it back."""
    return torch.cat([tokens.to(torch.float64), logprob_block(raw, tokens, idx, rows)])


def logprob_block(raw: torch.Tensor, tokens: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Float64 [L * (2 + 2 n)] for the L rows ``idx`` of the raw log-softmax ``raw``, n the most top logprobs
    any of them asks for: each chosen token's logprob, then its rank, then the top n ids, then their values."""
    if idx == list(range(raw.shape[0])):
        lp, tok = raw, tokens[: raw.shape[0]]
    else:
        idx_t = to_device(idx, torch.long, raw.device)
        lp, tok = raw.index_select(0, idx_t), tokens.index_select(0, idx_t)
    tok_lp = lp.gather(1, tok.unsqueeze(1))
    ranks = (lp > tok_lp).sum(dim=1) + 1
    parts = [tok_lp.squeeze(1).double(), ranks.double()]
    n_top = max(rows[i].params.logprobs or 0 for i in idx)
    if n_top:
        top_vals, top_ids = lp.topk(n_top, dim=-1)
        parts += [top_ids.flatten().double(), top_vals.flatten().double()]
    return torch.cat(parts)


def unpack_samples(values: list, rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """``Sampler.sample``'s result as host lists (``values``: its ``tolist()``): token ids and logprobs."""
    tokens = [int(t) for t in values[: len(rows)]]
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if len(values) > len(rows):
        idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        parsed = parse_logprob_block(values[len(rows) :], [tokens[i] for i in idx], [rows[i] for i in idx])
        for i, lp in zip(idx, parsed, strict=True):
            logprobs[i] = lp
    return tokens, logprobs


def parse_logprob_block(block: list[float], tokens: list[int], rows: Sequence[SamplingRow]) -> list[TokenLogprob]:
    """``logprob_block``'s values (host floats) for its rows, ``tokens`` their chosen ids."""
    n_rows = len(rows)
    n_top = max((r.params.logprobs or 0 for r in rows), default=0)
    ids_at, vals_at = 2 * n_rows, 2 * n_rows + n_rows * n_top
    out = []
    for j, r in enumerate(rows):
        n = r.params.logprobs or 0
        ids = block[ids_at + j * n_top : ids_at + j * n_top + n]
        vals = block[vals_at + j * n_top : vals_at + j * n_top + n]
        top = [(int(t), v) for t, v in zip(ids, vals, strict=True)]
        out.append(TokenLogprob(tokens[j], block[j], int(block[n_rows + j]), top))
    return out


def token_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, idx: list[int], rows: Sequence[SamplingRow]
) -> list[TokenLogprob]:
    """Logprobs (raw log-softmax ``raw``) of ``tokens[i]`` at the rows ``idx``, with each row's top ones
    (one copy to the host)."""
    idx_t = to_device(idx, torch.long, tokens.device)
    values = torch.cat([tokens.index_select(0, idx_t).double(), logprob_block(raw, tokens, idx, rows)]).tolist()
    return parse_logprob_block(values[len(idx) :], [int(t) for t in values[: len(idx)]], [rows[i] for i in idx])


def greedy_tokens(logits: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    """Each row's argmax, the first index on ties (as ``argmax``). On CPU with the C kernels their vectorised
    ``cb_argmax_f32``; else ``max``'s indices, a little faster than ``argmax`` but a scalar loop on CPU (87 us a
    row of 49,152 logits on the 2-core Xeon, 2.7 ms for 64 rows)."""
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return kernels.argmax(logits if logits.stride(-1) == 1 else logits.contiguous())
    return logits.max(dim=-1).indices
