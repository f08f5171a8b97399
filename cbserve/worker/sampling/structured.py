"""Structured output with xgrammar: grammars compiled from a request's ``StructuredSpec`` (cached per spec),
one grammar matcher per constrained sequence, and the token bitmask of a whole batch for the sampler.

Where the matchers live: in the worker that samples (tensor-parallel rank 0), keyed by sequence id. The
worker holds every sequence's token ids, its own samples included (it appends the token it samples right
after sampling, ``ModelRunner._keep_samples``; the scheduler sends only tokens it decided itself), so a
matcher is brought up to date lazily, just before its sequence is sampled, by accepting the output tokens
it has not seen. That is what async scheduling needs: step N+1 runs before the scheduler has seen step N's
token, and its bitmask already accounts for that token. Preemption and forks need nothing special: a
recomputed sequence or a fork child arrives as a new request with all its tokens and gets a fresh matcher
that replays them (a rollback by rebuilding). The scheduler stays free of xgrammar and torch, and no
bitmask crosses the Ray hop.

When a grammar is complete, the bitmask allows only the stop (EOS) tokens, so the sequence ends with EOS
through the ordinary stop rule; EOS is masked while the grammar is incomplete. Once the matcher has
accepted EOS it is terminated and the row is left unconstrained: under async scheduling the step already
scheduled after the EOS samples one more token, which the scheduler drops with the finished sequence.

Reasoning models (the spec's ``reasoning_end``, set by the front end when the request reasons): the grammar
holds the answer, not the thinking. The matcher stays dormant (no bitmask, no token accepted) while the
output is inside the reasoning, and takes the tokens from the one after the first ``reasoning_end`` on; with
``reasoning_start`` the first token is masked to the grammar's first tokens plus ``reasoning_start``, and only
an output that opens with it reasons. The gate's position is part of the matcher's lazy catch-up (it is
recomputed from the tokens), so async scheduling, preemption and forks stay as above. A step whose
constrained rows all reason has no bitmask at all.

The front end compiles each spec with the same ``GrammarCompilerCache`` when it validates a request, so a
spec that does not compile is a 400 there and never reaches a worker. Grammars are cached by what they depend
on (``StructuredSpec.grammar_key``), so one spec with and without a reasoning gate compiles once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cbserve.scheduler.errors import StepFailedError
from cbserve.scheduler.requests.sampling_params import StructuredSpec

if TYPE_CHECKING:
    from cbserve.worker.cpu.kernels import CpuKernels
    from cbserve.worker.faults import FaultPlan

logger = logging.getLogger(__name__)

_XGR_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
DEFAULT_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A structured-output spec that cannot be compiled (the message names the problem)."""


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF that matches exactly one of ``choices``."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return _XGR_LOG_PREFIX.sub("", lines[0]) if lines else type(e).__name__


class GrammarCompilerCache:
    """An xgrammar compiler for one tokenizer, with the compiled grammars of the last ``max_size`` specs."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_size: int = 256) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops or None)
        self.stop_token_ids = tuple(info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.max_size = max_size
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def get(self, spec: StructuredSpec) -> Any:
        """The compiled grammar of ``spec`` (shared by specs that differ only in their reasoning gate);
        GrammarError when it does not compile."""
        key = spec.grammar_key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiled = self._compile(spec)
        self._cache[key] = compiled
        if len(self._cache) > self.max_size:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self.compiler
        try:
            if spec.kind == "json":
                json.loads(spec.spec)  # a clear message for malformed JSON
                return c.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":  # any object, in the same compact layout as a schema's
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                choices = json.loads(spec.spec)
                if not isinstance(choices, list):
                    raise GrammarError("choice must be a list of strings")
                return c.compile_grammar(choice_grammar(choices))
            return c.compile_grammar(spec.spec)
        except GrammarError:
            raise
        except json.JSONDecodeError as e:
            raise GrammarError(f"invalid {spec.kind} for structured output: malformed JSON: {e}") from e
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise GrammarError(f"invalid {spec.kind} for structured output: {_clean(e)}") from e


def load_grammar_tokenizer(model_folder: Path) -> Any:
    """The model's tokenizer, as the front end loads it (xgrammar reads its vocabulary)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_folder / "tokenizer.json").exists():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(model_folder))
        except Exception:  # noqa: BLE001 - fall back to the class the folder names
            pass
    return AutoTokenizer.from_pretrained(str(model_folder))


@dataclass
class _Matcher:
    owner: object  # the worker's state object of the sequence: a new one (preempted, resumed) starts over
    matcher: Any
    spec: StructuredSpec
    seen: int = 0  # output tokens taken so far: by the reasoning gate, then by the grammar
    answer_from: int | None = 0  # output index of the answer's first token (None: not known yet)
    broken: bool = False

    def __post_init__(self) -> None:
        if self.spec.reasoning_end is not None:
            self.answer_from = None

    @property
    def undecided(self) -> bool:
        """Its first token is next and may open the reasoning or start the answer."""
        return self.answer_from is None and self.seen == 0 and self.spec.reasoning_start is not None

    @property
    def done(self) -> bool:
        return self.broken or self.matcher.is_terminated()

    @property
    def constraining(self) -> bool:
        """Its next token is masked: the answer has started and its grammar has not ended, or it is undecided."""
        return not self.done and (self.answer_from is not None or self.undecided)

    def gate(self, token: int) -> bool:
        """An output token before the answer: True when it belongs to the reasoning (its tags included), False
        when the answer starts with it (a first token that does not open the reasoning)."""
        if self.undecided and token != self.spec.reasoning_start:
            self.answer_from = self.seen
            return False
        if token == self.spec.reasoning_end:
            self.answer_from = self.seen + 1
        self.seen += 1
        return True


class StructuredOutputs:
    """The matchers of one worker's constrained sequences. ``bitmask(...)`` before sampling;
    ``drop(ids)`` when sequences finish or are preempted. The compiler is built on first use."""

    def __init__(self, model_folder: Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.model_folder = model_folder
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compilers: GrammarCompilerCache | None = None
        self.matchers: dict[str, _Matcher] = {}
        self.fault: FaultPlan | None = None  # a test model's injected fault (faults.py)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made on first use
        # threads filling the bitmask: the fill runs between forward passes, so the worker's cores are free
        self.fill_threads = max(1, torch.get_num_threads())

    @property
    def compilers(self) -> GrammarCompilerCache:
        if self._compilers is None:
            tok = load_grammar_tokenizer(self.model_folder)
            stops = [*self.stop_token_ids, *([tok.eos_token_id] if tok.eos_token_id is not None else [])]
            self._compilers = GrammarCompilerCache(tok, self.vocab_size, stops, DEFAULT_CACHE_SIZE)
        return self._compilers

    def drop(self, seq_ids: Any) -> None:
        for s in seq_ids:
            self.matchers.pop(s, None)

    def _current(self, seq_id: str, owner: object, row: Any) -> _Matcher:
        """The sequence's matcher; a new one for a new sequence, a new owner or fewer tokens (preempted)."""
        import xgrammar as xgr

        m = self.matchers.get(seq_id)
        if m is None or m.owner is not owner or m.seen > len(row.token_ids) - row.num_prompt_tokens:
            spec = row.params.structured
            m = _Matcher(owner, xgr.GrammarMatcher(self.compilers.get(spec)), spec)
            self.matchers[seq_id] = m
        return m

    @staticmethod
    def _accepted(seq_id: str, m: _Matcher, token: int, ok: bool) -> None:
        if not ok:
            logger.error("sequence %s: token %d is outside its grammar; no longer constrained", seq_id, token)
            m.broken = True
        m.seen += 1

    def _catch_up(self, seq_id: str, m: _Matcher, row: Any) -> None:
        """Take the sequence's output tokens the matcher has not seen, one by one: the reasoning gate's until
        the answer starts, then the grammar's."""
        tokens, start = row.token_ids, row.num_prompt_tokens
        while not m.done and m.seen < len(tokens) - start:
            token = tokens[start + m.seen]
            if m.answer_from is None and m.gate(token):
                continue
            self._accepted(seq_id, m, token, m.matcher.accept_token(token))

    def _batcher(self) -> Any:
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=self.fill_threads)
        return self._batch

    def _advance(self, rows: Sequence[tuple[str, object, Any]]) -> list[tuple[int, _Matcher]]:
        """Bring the constrained rows' matchers up to date; returns (row, matcher) of those whose next token is
        masked. The usual case, one new answer token per sequence, is accepted for all of them in one call."""
        seen: list[tuple[int, _Matcher]] = []
        one: list[tuple[str, _Matcher, int]] = []
        for j, (seq_id, owner, row) in enumerate(rows):
            if row.params.structured is None:
                continue
            with _blame(seq_id):  # a matcher that raises fails its sequence alone (worker/runner/step_guard.py)
                if self.fault is not None:
                    self.fault.check_sequence(row.token_ids)
                m = self._current(seq_id, owner, row)
                seen.append((j, m))
                behind = len(row.token_ids) - row.num_prompt_tokens - m.seen
                if behind == 1 and m.answer_from is not None and not m.done:
                    one.append((seq_id, m, row.token_ids[-1]))
                else:
                    self._catch_up(seq_id, m, row)
        if one:
            batcher = self._batcher()
            oks = _each_blamed([s for s, _, _ in one], lambda idx: batcher.batch_accept_token(
                [one[i][1].matcher for i in idx], [one[i][2] for i in idx]))
            for (seq_id, m, token), ok in zip(one, oks, strict=True):
                self._accepted(seq_id, m, token, ok)
        return [(j, m) for j, m in seen if m.constraining]

    def bitmask(self, rows: Sequence[tuple[str, object, Any]]) -> torch.Tensor | None:
        """The token bitmask [len(rows), ceil(vocab / 32)] int32 of a batch's sampled rows, each given as
        (sequence id, its worker state, its SamplingRow); None when no row is masked (no constrained row, or
        all of them reasoning). Unconstrained rows allow every token; an undecided row's grammar, its
        reasoning's opening token too. The masked rows are filled in one call (xgrammar's threads)."""
        if not any(r.params.structured is not None for _, _, r in rows):
            return None
        live = self._advance(rows)
        if not live:
            return None
        # All allowed (-1). numpy, not torch.full: no trip through torch's thread pool for a small buffer.
        words = np.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        mask = torch.from_numpy(words)
        # A sequence sampled several times at once (n > 1 at its fork) has one matcher for several rows: fill it
        # once and copy the row (xgrammar's threads filling one matcher twice at the same time corrupt it).
        first: dict[int, int] = {}  # id(matcher) -> its first row
        fill: list[tuple[int, _Matcher]] = []
        copies: list[tuple[int, int]] = []  # (row, the row filled for its matcher)
        for j, m in live:
            k = first.setdefault(id(m), j)
            if k == j:
                fill.append((j, m))
            else:
                copies.append((j, k))
        batcher = self._batcher()
        _each_blamed([rows[j][0] for j, _ in fill], lambda idx: batcher.batch_fill_next_token_bitmask(
            [fill[i][1].matcher for i in idx], mask, [fill[i][0] for i in idx]))
        bits = words.view(np.uint32)
        for j, m in fill:
            if m.undecided:  # the first token may also open the reasoning
                t = int(m.spec.reasoning_start)  # type: ignore[arg-type]
                bits[j, t // 32] |= np.uint32(1 << (t % 32))
        for j, k in copies:
            mask[j] = mask[k]
        return mask


@contextlib.contextmanager
def _blame(seq_id: str) -> Iterator[None]:
    """What raises inside fails sequence ``seq_id`` alone (``StepFailedError`` naming it)."""
    try:
        yield
    except StepFailedError:
        raise
    except Exception as e:
        raise StepFailedError(f"structured output of {seq_id}: {type(e).__name__}: {e}", [seq_id]) from e


def _each_blamed(seq_ids: list[str], call: Callable[[list[int]], Any]) -> Any:
    """``call(indices)`` over all of ``seq_ids`` at once (xgrammar's batched calls); when it raises, each one alone
    tells which sequences to blame (their state is dropped with the failed step anyway)."""
    try:
        return call(list(range(len(seq_ids))))
    except Exception as e:
        bad = []
        for i, seq_id in enumerate(seq_ids):
            try:
                call([i])
            except Exception:
                bad.append(seq_id)
        raise StepFailedError(f"structured output of {bad or seq_ids}: {type(e).__name__}: {e}", bad) from e


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, inplace: bool = False, kernels: CpuKernels | None = None
) -> torch.Tensor:
    """``logits`` [rows, vocab] with the tokens each row's bitmask forbids at -inf (a copy unless
    ``inplace``). On CPU with the C kernels given, their vectorised mask (~30x xgrammar's CPU kernel, which
    tests every token's bit: 7 ms for 64 rows of a 49k vocabulary here); elsewhere xgrammar's."""
    out = logits if inplace else logits.clone()
    if kernels is not None and out.device.type == "cpu" and out.dtype == torch.float32 and out.dim() == 2:
        return kernels.apply_token_bitmask_(out, bitmask)
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), vocab_size=out.shape[1])
    return out
