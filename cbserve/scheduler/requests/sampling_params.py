"""Sampling parameters of one request, validated at construction.

Every check raises ``ValueError`` naming the offending field, so the HTTP edge can turn it into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_N = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on a request's output (structured output), as plain strings so it pickles cheaply and
    hashes as a grammar-cache key. ``kind``: "json" (``spec`` is a JSON schema, as JSON text),
    "json_object" (any JSON object; ``spec`` unused), "regex" (a regular expression), "choice" (a JSON
    list of the allowed strings) or "grammar" (EBNF, xgrammar's dialect). The worker compiles it
    (worker/sampling/structured.py); the front end compiles it first, so a bad spec is a 400, not a worker error.

    The reasoning gate (a reasoning model: the grammar holds the answer, not the thinking before it):
    ``reasoning_end`` set, the grammar starts at the token after the first ``reasoning_end`` token of the
    output and no token before it is masked. ``reasoning_start`` set too, the output reasons only if its first
    token is ``reasoning_start`` (that first token may be it or any token the grammar allows); unset, the
    output starts inside the reasoning. Both None: the grammar holds from the first token."""

    kind: str
    spec: str = ""
    reasoning_start: int | None = None  # token id opening the reasoning (None: the output starts inside it)
    reasoning_end: int | None = None  # token id ending it (None: no reasoning gate)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured output spec must be a string, got {type(self.spec).__name__}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind!r} needs a non-empty spec")
        for name in ("reasoning_start", "reasoning_end"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0, hi=None)
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("structured output reasoning_start needs reasoning_end")

    @property
    def grammar_key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (not the reasoning gate): the grammar caches' key."""
        return self.kind, self.spec


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request (OpenAI / vLLM semantics).

    ``temperature == 0`` means greedy. ``n`` sequences are returned; ``best_of`` (>= n) are generated
    and the n with the highest cumulative logprob are kept. With ``use_beam_search`` the beam width is
    ``best_of`` (or ``n`` when unset). ``logprobs`` asks for the sampled token's logprob plus the top
    ``logprobs`` alternatives at every step (0 = the sampled token only, None = none).

    Token constraints (applied by the worker after penalties, before temperature): ``logit_bias``
    ((token id, bias in [-100, 100]) pairs added to the logits), ``allowed_token_ids`` (only these may be
    sampled), ``bad_words_token_ids`` (token sequences that may not be generated: a one-token word is never
    sampled, a longer one's last token is banned right after its other tokens). ``prompt_logprobs``: the
    logprob of every prompt token after the first (plus that many alternatives), computed at prefill.
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None  # output constrained by a grammar (None: free text)
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    # Derived once when built (plain attributes: the scheduler and the sampler read them every step).
    num_sequences: int = field(init=False, compare=False)  # sequences generated (best_of >= n; the beam width)
    greedy: bool = field(init=False, compare=False)
    has_token_constraints: bool = field(init=False, compare=False)
    needs_penalties: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        # Normalise list inputs (JSON gives lists) to tuples so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        derived = {
            "num_sequences": self.best_of if self.best_of is not None else self.n,
            "greedy": self.temperature == 0.0 or self.top_k == 1,
            "has_token_constraints": bool(self.logit_bias) or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids),
            "needs_penalties": self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        self._validate()

    # ---- validation -------------------------------------------------------------------------
    def _validate(self) -> None:
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, lo=self.n, hi=MAX_N)
        _check_number("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, lo=-1, hi=None)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=None)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        _check_number("length_penalty", self.length_penalty, lo=None, hi=None)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=None, hi=None)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=None)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0, hi=None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        self._validate_token_constraints()
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValueError(f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
            if self.use_beam_search:  # beams are ranked by unconstrained logprobs: not supported together
                raise ValueError("structured output cannot be combined with use_beam_search")
            if self.ignore_eos:  # the grammar ends the output with EOS
                raise ValueError("structured output cannot be combined with ignore_eos")
        if self.use_beam_search:
            if self.temperature != 0.0 and self.extra.get("beam_allow_temperature") is None:
                raise ValueError("use_beam_search requires temperature=0")
            if self.num_sequences < 2:
                raise ValueError("use_beam_search needs a beam width (best_of or n) of at least 2")

    def _validate_token_constraints(self) -> None:
        for token, bias in self.logit_bias:
            _check_int("logit_bias token id", token, lo=0, hi=None)
            _check_number("logit_bias value", bias, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            for t in self.allowed_token_ids:
                _check_int("allowed_token_ids", t, lo=0, hi=None)
        for word in self.bad_words_token_ids:
            if not word:
                raise ValueError("bad_words must not contain an empty word")
            for t in word:
                _check_int("bad_words token id", t, lo=0, hi=None)

    # ---- derived ------------------------------------------------------------------------------
    @property
    def beam_width(self) -> int:
        """The beam width under ``use_beam_search``: the sequences it generates."""
        return self.num_sequences


def _check_int(name: str, value: object, lo: int | None, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def _check_number(name: str, value: object, lo: float | None, hi: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
