"""Bookkeeping of LLM.generate(): per-sequence detokenization (stop strings), results in input order and
a tqdm progress bar with output throughput."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cbserve.scheduler.request import RequestOutput
from cbserve.scheduler.sampling_params import SamplingParams
from cbserve.worker.tokenizer import IncrementalDetokenizer
from tqdm.auto import tqdm

from .llm import CompletionOutput, GenerateOutput


@dataclass
class _Seq:
    out: CompletionOutput
    detok: IncrementalDetokenizer


class GenerationTracker:
    def __init__(self, tokenizer: Any, use_tqdm: bool, total: int) -> None:
        self.tokenizer = tokenizer
        self.order: list[str] = []
        self.results_by_id: dict[str, GenerateOutput] = {}
        self.params: dict[str, SamplingParams] = {}
        self.seqs: dict[tuple[str, int], _Seq] = {}
        self.unfinished: set[str] = set()
        self.num_output_tokens = 0
        self.start = time.perf_counter()
        self.bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm)

    def add(self, req_id: str, text: str | None, ids: list[int], sp: SamplingParams) -> None:
        self.order.append(req_id)
        self.results_by_id[req_id] = GenerateOutput(req_id, text, ids)
        self.params[req_id] = sp
        self.unfinished.add(req_id)

    def unfinished_ids(self) -> list[str]:
        return sorted(self.unfinished)

    def _seq(self, req_id: str, index: int) -> _Seq:
        key = (req_id, index)
        if key not in self.seqs:
            sp = self.params[req_id]
            detok = IncrementalDetokenizer(
                self.tokenizer,
                self.results_by_id[req_id].prompt_token_ids,
                sp.skip_special_tokens,
                sp.stop,
                sp.include_stop_str_in_output,
            )
            lps = [] if sp.logprobs is not None else None
            self.seqs[key] = _Seq(CompletionOutput(index, "", [], None, lps), detok)
        return self.seqs[key]

    def on_output(self, o: RequestOutput) -> bool:
        """Apply one RequestOutput; True when a stop string ended the sequence and the engine must be told."""
        if o.req_id not in self.results_by_id:
            return False
        seq = self._seq(o.req_id, o.index)
        out, must_finish = seq.out, False
        if o.final_token_ids is not None:  # best_of / beam: the whole output at once
            seq = self.seqs[(o.req_id, o.index)] = _Seq(CompletionOutput(o.index, "", [], None), seq.detok)
            seq.detok = self._fresh_detok(o.req_id)
            out = seq.out
            out.logprobs = list(o.new_logprobs) if o.new_logprobs is not None else None
        elif o.new_logprobs is not None and out.logprobs is not None:
            out.logprobs.extend(o.new_logprobs)
        if not seq.detok.stopped and o.new_token_ids:
            out.token_ids.extend(o.new_token_ids)
            self.num_output_tokens += len(o.new_token_ids)
            upd = seq.detok.add_tokens(o.new_token_ids)
            out.text += upd.new_text
            if upd.stopped:
                out.stop_reason = upd.stop_str
                must_finish = not o.finished
        if o.cumulative_logprob is not None:
            out.cumulative_logprob = o.cumulative_logprob
        if o.finished:
            out.text += seq.detok.flush()
            out.finish_reason = "stop" if seq.detok.stopped else o.finish_reason
            self._maybe_complete(o)
        return must_finish

    def _fresh_detok(self, req_id: str) -> IncrementalDetokenizer:
        sp = self.params[req_id]
        return IncrementalDetokenizer(
            self.tokenizer,
            self.results_by_id[req_id].prompt_token_ids,
            sp.skip_special_tokens,
            sp.stop,
            sp.include_stop_str_in_output,
        )

    def _maybe_complete(self, o: RequestOutput) -> None:
        result = self.results_by_id[o.req_id]
        result.num_cached_tokens = o.num_cached_tokens
        n = self.params[o.req_id].n
        done = [self.seqs[(o.req_id, i)] for i in range(n) if (o.req_id, i) in self.seqs]
        if len(done) == n and all(s.out.finish_reason is not None for s in done):
            result.outputs = [s.out for s in done]
            self.unfinished.discard(o.req_id)
            self.bar.update()
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"{self.num_output_tokens / elapsed:.1f} output tok/s", refresh=False)

    def results(self) -> list[GenerateOutput]:
        return [self.results_by_id[r] for r in self.order]

    def close(self) -> None:
        self.bar.close()
