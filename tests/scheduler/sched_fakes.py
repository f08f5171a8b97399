"""A fake worker for scheduler tests: it follows the SchedulerOutput protocol strictly (asserting it),
keeps a fake physical KV cache (each slot holds (position, token)) so that wrong block tables, missed
copy-on-write copies or bad prefix-cache hits are caught, and "samples" deterministic tokens that depend
on the context (like a greedy model), with EOS on cue."""

from __future__ import annotations

import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field

from cbserve.scheduler import (
    CacheConfig,
    EngineConfig,
    EngineCore,
    EngineRequest,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    SpeculativeConfig,
    TokenLogprob,
)
from cbserve.scheduler.engine_core import StepResult
from cbserve.scheduler.outputs import done_future
from cbserve.scheduler.requests.lora import LoRARequest

VOCAB = 1000
EOS = 999


def next_token(tokens: list[int], sample_index: int = 0) -> int:
    """A deterministic 'greedy model': a function of the context only (never EOS by itself)."""
    return (tokens[-1] * 31 + len(tokens) * 7 + sample_index * 101 + sum(tokens[-4:])) % (VOCAB - 1)


def copying_next_token(tokens: list[int], sample_index: int = 0) -> int:
    """A 'greedy model' that mostly copies (the n-gram proposer's sweet spot, so drafts are both accepted
    and rejected): the token that followed the last token's previous occurrence, except at every third
    length (where it makes a new one up); with no previous occurrence, an earlier token. Still a function
    of the context only."""
    last = tokens[-1]
    if len(tokens) % 3 and sample_index == 0:
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == last:
                return tokens[i + 1]
        return tokens[(len(tokens) * 7) % len(tokens)]  # an earlier token: the next one copies
    return next_token(tokens, sample_index)


def logprob_of(token: int) -> float:
    return -((token % 17) + 1) / 10.0


def top_candidates(tokens: list[int], k: int, eos_second: bool) -> list[tuple[int, float]]:
    """Beam-search view of the fake model: k distinct candidates, logprobs strictly decreasing; with
    ``eos_second``, EOS is the second candidate."""
    first = next_token(tokens)
    top = []
    for j in range(k):
        tok = next_token(tokens, j)
        if eos_second and j == 1:
            tok = EOS
        top.append((tok, logprob_of(first) - 0.05 * j - 0.01 * (tok % 5)))
    return top


@dataclass
class WorkerReq:
    tokens: list[int]
    blocks: list[int]
    num_computed: int
    num_prompt: int
    num_samples: int
    want_logprobs: int | None
    seed: int | None
    beam: bool = False


@dataclass
class FakeExecutor:
    block_size: int
    num_blocks: int
    eos_after: dict[str, int] = field(default_factory=dict)  # seq id -> EOS as output token number k
    verify: bool = True
    calls: list[SchedulerOutput] = field(default_factory=list)
    keep_calls: bool = True
    copying: bool = False  # the model copies (copying_next_token): drafts get accepted
    num_verified: int = 0  # draft tokens seen / accepted (speculative decoding)
    num_accepted: int = 0
    draft_k: int = 0  # a fake draft model: k proposals per sampled sequence, returned with the output

    def __post_init__(self) -> None:
        bs = self.block_size
        self.kv: list[list[tuple[int, int] | None]] = [[None] * bs for _ in range(self.num_blocks)]
        self.reqs: dict[str, WorkerReq] = {}

    def execute_model(self, so: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """The Executor protocol: the step runs in place (``run``) and its future comes back done."""
        return done_future(self.run(so))

    def run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """What the worker does with one step."""
        if self.keep_calls:
            self.calls.append(so)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            assert rid in self.reqs, f"told to drop {rid} which the worker never saw"
            del self.reqs[rid]
        for src, dst in so.block_copies:
            self.kv[dst] = list(self.kv[src])
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            self.reqs[new.req_id] = WorkerReq(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.num_prompt_tokens,
                new.num_samples, new.sampling_params.logprobs, new.seed, new.sampling_params.use_beam_search,
            )  # fmt: skip
        for cached in so.scheduled_cached_reqs:
            req = self.reqs[cached.req_id]
            assert req.num_computed == cached.num_computed_tokens, (cached, req.num_computed)
            req.tokens.extend(cached.new_token_ids)
            req.blocks.extend(cached.new_block_ids)
        ids = {r.req_id for r in so.scheduled_new_reqs} | {r.req_id for r in so.scheduled_cached_reqs}
        assert ids == set(so.num_scheduled_tokens), "scheduled ids and num_scheduled_tokens disagree"
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        if self.verify:
            for rid in so.num_scheduled_tokens:
                self._verify_context(rid)
        spec = so.scheduled_spec_decode_tokens
        for rid, num in so.num_scheduled_tokens.items():
            self._write(rid, num, spec.get(rid, []))
        return self._sample(so)

    def _slot(self, req: WorkerReq, pos: int) -> tuple[int, int]:
        assert pos // self.block_size < len(req.blocks), f"no block for position {pos}"
        return req.blocks[pos // self.block_size], pos % self.block_size

    def _verify_context(self, rid: str) -> None:
        req = self.reqs[rid]
        for pos in range(req.num_computed):
            b, o = self._slot(req, pos)
            assert self.kv[b][o] == (pos, req.tokens[pos]), f"{rid}: bad KV at {pos} in block {b}"

    def _write(self, rid: str, num: int, drafts: list[int]) -> None:
        req = self.reqs[rid]
        tokens = req.tokens + drafts
        assert num > 0 and req.num_computed + num <= len(tokens), (rid, num, req.num_computed)
        assert not drafts or req.num_computed + num == len(tokens), "drafts must end the scheduled tokens"
        for pos in range(req.num_computed, req.num_computed + num):
            b, o = self._slot(req, pos)
            self.kv[b][o] = (pos, tokens[pos])
        req.num_computed += num - len(drafts)

    def _sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput(forward_time_s=0.001)
        spec = so.scheduled_spec_decode_tokens
        for rid in so.num_scheduled_tokens:
            req = self.reqs[rid]
            if rid in spec:
                self._verify_drafts(rid, req, spec[rid], out)
                continue
            if req.num_computed != len(req.tokens):
                continue
            at_prompt_end = req.num_computed == req.num_prompt
            num = req.num_samples if at_prompt_end else 1
            toks = [self._token(rid, req, i) for i in range(num)]
            out.req_ids.append(rid)
            out.sampled_token_ids.append(toks)
            if req.want_logprobs is None:
                out.logprobs.append(None)
            elif req.want_logprobs > 1:  # beam search: a top list of distinct candidates
                top = top_candidates(req.tokens, req.want_logprobs, self._eos_candidate(rid, req))
                out.sampled_token_ids[-1] = [top[0][0]]
                out.logprobs.append([TokenLogprob(top[0][0], top[0][1], 1, top)])
            else:
                out.logprobs.append([TokenLogprob(t, logprob_of(t), 1, [(t, logprob_of(t))]) for t in toks])
            if len(out.sampled_token_ids[-1]) == 1 and not req.beam:  # as ModelRunner._keep_samples
                req.tokens.append(out.sampled_token_ids[-1][0])
        if self.draft_k:
            out.draft_token_ids = {rid: self._draft(self.reqs[rid].tokens) for rid in out.req_ids}
        return out

    def _draft(self, tokens: list[int]) -> list[int]:
        """The fake model's own continuation, wrong at every fifth length (drafts accepted and rejected)."""
        toks, out = list(tokens), []
        for _ in range(self.draft_k):
            t = copying_next_token(toks) if self.copying else next_token(toks, 0)
            t = t if len(toks) % 5 else (t + 1) % (VOCAB - 1)
            out.append(t)
            toks.append(t)
        return out

    def _verify_drafts(self, rid: str, req: WorkerReq, drafts: list[int], out: ModelRunnerOutput) -> None:
        """Greedy verification against the fake model: drafts while they match, then the model's token;
        kept like samples, with the worker's rollback (computed to the last token, blocks trimmed)."""
        assert not req.beam and req.num_computed == len(req.tokens), (rid, req.num_computed, len(req.tokens))
        n_before = len(req.tokens)
        toks: list[int] = []
        for j in range(len(drafts) + 1):
            t = self._token(rid, req, 0)
            toks.append(t)
            req.tokens.append(t)
            if j == len(drafts) or t != drafts[j]:
                break
        self.num_verified += len(drafts)
        self.num_accepted += len(toks) - 1
        out.req_ids.append(rid)
        out.sampled_token_ids.append(toks)
        lps = None if req.want_logprobs is None else [TokenLogprob(t, logprob_of(t), 1, []) for t in toks]
        out.logprobs.append(lps)
        req.num_computed = len(req.tokens) - 1
        assert req.num_computed >= n_before
        del req.blocks[-(-len(req.tokens) // self.block_size) :]

    def _eos_candidate(self, rid: str, req: WorkerReq) -> bool:
        at = self.eos_after.get(rid.split("#")[0])
        return at is not None and len(req.tokens) - req.num_prompt + 1 >= at

    def _token(self, rid: str, req: WorkerReq, sample_index: int) -> int:
        num_out = len(req.tokens) - req.num_prompt + 1
        base = rid if sample_index == 0 else f"{rid}#{sample_index}"
        if self.eos_after.get(base) == num_out:
            return EOS
        if self.copying:
            return copying_next_token(req.tokens, sample_index)
        return next_token(req.tokens, sample_index)

    def shutdown(self) -> None:
        pass


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_engine(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    max_batched: int = 64,
    max_seqs: int = 16,
    max_model_len: int = 128,
    policy: str = "continuous",
    ordering: str = "fcfs",
    chunked: bool = True,
    caching: bool = True,
    max_waiting: int = 4096,
    clock: FakeClock | None = None,
    eos_after: dict[str, int] | None = None,
    speculative: SpeculativeConfig | None = None,
    copying: bool = False,
    draft_k: int = 0,
    **sched_kw: object,
) -> tuple[EngineCore, FakeExecutor]:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_batched, max_num_seqs=max_seqs, max_model_len=max_model_len,
            policy=policy, ordering=ordering, enable_chunked_prefill=chunked, max_waiting=max_waiting,
            **sched_kw,  # type: ignore[arg-type]
        ),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
        speculative=speculative,
    )  # fmt: skip
    executor = FakeExecutor(block_size, num_blocks, eos_after=dict(eos_after or {}), copying=copying,
                            draft_k=draft_k)
    return EngineCore(config, executor, clock=clock or FakeClock()), executor


def req(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int | None = 8,
    priority: int = 0,
    salt: str | None = None,
    lora: LoRARequest | None = None,
    **params: object,
) -> EngineRequest:
    if isinstance(prompt, int):  # crc32, not hash(): the same prompt under every PYTHONHASHSEED
        prompt = [(zlib.crc32(req_id.encode()) + i) % 500 for i in range(prompt)]
    return EngineRequest(
        req_id=req_id, prompt_token_ids=list(prompt), eos_token_id=EOS, priority=priority, cache_salt=salt,
        lora=lora, sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
    )  # fmt: skip


@dataclass
class Collected:
    tokens: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    reasons: dict[tuple[str, int], str] = field(default_factory=dict)
    final: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    results: list = field(default_factory=list)


class Overlapped:
    """Drives an engine with its own pipelined loop, as the SchedulerActor does (``step_with_batch_queue``): with
    async scheduling step N+1 is scheduled, and run by the in-order worker, before step N's output is applied
    (``engine.step()`` never overlaps)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine

    def step(self) -> list[StepResult]:
        result = self.engine.step_with_batch_queue()
        return [] if result is None else [result]

    @property
    def busy(self) -> bool:
        return self.engine.has_work()


def run(
    engine: EngineCore, max_steps: int = 10_000, check: bool = True, into: Collected | None = None,
    driver: Overlapped | None = None,
) -> Collected:
    """Step until every request finished (``driver``: overlapped, else ``engine.step()``)."""
    col = into or Collected()
    for _ in range(max_steps):
        if not (engine.has_unfinished_requests() if driver is None else driver.busy):
            break
        for res in [engine.step()] if driver is None else driver.step():
            col.results.append(res)
            collect(res, col)
        if check:
            engine.check_integrity()
    else:
        raise AssertionError("engine did not finish")
    return col


def collect(res: object, col: Collected) -> None:
    for o in res.outputs:  # type: ignore[attr-defined]
        key = (o.req_id, o.index)
        assert key not in col.reasons, f"output after finish for {key}"
        col.tokens.setdefault(key, []).extend(o.new_token_ids)
        if o.final_token_ids is not None:
            col.final[key] = list(o.final_token_ids)
        if o.finished:
            col.reasons[key] = o.finish_reason


def expected_tokens(prompt: list[int], max_tokens: int, eos_at: int | None = None) -> list[int]:
    """What the fake model generates for a single sequence (no n>1)."""
    toks = list(prompt)
    out = []
    for k in range(1, max_tokens + 1):
        t = EOS if eos_at == k else next_token(toks)
        out.append(t)
        toks.append(t)
        if t == EOS:
            break
    return out
