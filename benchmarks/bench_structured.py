"""Structured output cost: grammar compile time (cold and cached) and the tokens/s of a burst of JSON-schema
requests against the same burst unconstrained, offline with ``cbserve.LLM`` (bundled SmolLM2-135M-Instruct).

For a fair comparison both bursts generate the same number of tokens per request: the JSON-schema burst
runs first (each output ends when its JSON is complete), then the unconstrained burst asks every request
for exactly as many tokens as its JSON twin produced (``ignore_eos``). Rounds alternate (json, free, json,
free, ...) so drifting machine load hits both. Goal: JSON-schema tokens/s within 10% of unconstrained.

    python benchmarks/bench_structured.py                      # 64 requests, 2 rounds
    python benchmarks/bench_structured.py --num-requests 8 --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
TOPICS = ["a baker", "a pilot", "a student", "a painter", "a farmer", "a nurse", "a chess player", "a sailor"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--max-num-seqs", type=int, default=64)
    return p.parse_args()


def compile_times(llm: Any) -> dict[str, float]:
    """Seconds to build the grammar compiler (tokenizer vocabulary, once per process), to compile the schema
    the first time (cold) and again (cached), and a second, different schema cold."""
    from cbserve.scheduler.requests.sampling_params import StructuredSpec
    from cbserve.worker.sampling.structured import GrammarCompilerCache, load_grammar_tokenizer

    runner = llm.executor.runner
    t0 = time.perf_counter()
    cache = GrammarCompilerCache(load_grammar_tokenizer(runner.model_folder), runner.structured.vocab_size,
                                 runner.eos_token_ids)  # fmt: skip
    t1 = time.perf_counter()
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    cache.get(spec)
    t2 = time.perf_counter()
    cache.get(StructuredSpec("json", json.dumps(SCHEMA)))
    t3 = time.perf_counter()
    other = dict(SCHEMA, properties=dict(SCHEMA["properties"], email={"type": "string", "maxLength": 40}))
    cache.get(StructuredSpec("json", json.dumps(other)))
    t4 = time.perf_counter()
    return {"compiler_init_s": t1 - t0, "cold_s": t2 - t1, "cached_s": t3 - t2, "cold_other_s": t4 - t3}


class GrammarTimer:
    """Wall time the worker spends on structured output (bitmask fill + masking), summed over a burst: a
    share of the burst's time that shared-machine noise inflates about as much as the rest."""

    def __init__(self, llm: Any) -> None:
        import cbserve.worker.sampling.sampler as sampler_mod

        self.seconds = 0.0
        structured = llm.executor.runner.structured
        fill, apply = structured.bitmask, sampler_mod.apply_bitmask
        structured.bitmask = self._timed(fill)
        sampler_mod.apply_bitmask = self._timed(apply)

    def _timed(self, fn: Any) -> Any:
        def run(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return run


def burst(llm: Any, prompts: list[Any], params: list[Any]) -> tuple[float, list[int], list[str]]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [len(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


def main() -> None:
    args = parse_args()
    from cbserve import LLM, SamplingParams, StructuredSpec

    llm = LLM(progress=False, max_num_seqs=args.max_num_seqs)
    times = compile_times(llm)
    print("grammar compile: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()))
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    convs = [[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON (request {i})."}]
             for i in range(args.num_requests)]  # fmt: skip
    prompts = [llm.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
    json_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, structured=spec)
                   for i in range(args.num_requests)]  # fmt: skip
    burst(llm, prompts[:4], json_params[:4])  # warm-up (kernels, matchers, allocator)
    rates: dict[str, list[float]] = {"json": [], "free": []}
    timer = GrammarTimer(llm)
    for r in range(args.rounds):
        timer.seconds = 0.0
        t_json, lens, texts = burst(llm, prompts, json_params)
        grammar_s = timer.seconds
        valid = sum(_parses(t) for t in texts)
        free_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
                       for i, n in enumerate(lens)]  # fmt: skip
        t_free, free_lens, _ = burst(llm, prompts, free_params)
        assert free_lens == lens, "the unconstrained burst must generate the same token counts"
        rates["json"].append(sum(lens) / t_json)
        rates["free"].append(sum(lens) / t_free)
        print(f"round {r}: {sum(lens)} output tokens; json-schema {t_json:.2f} s ({rates['json'][-1]:.1f} tok/s, "
              f"{valid}/{len(texts)} valid JSON; bitmask fill + masking {grammar_s:.2f} s = "
              f"{100 * grammar_s / t_json:.1f}%), unconstrained {t_free:.2f} s ({rates['free'][-1]:.1f} tok/s)")
    j, f = statistics.mean(rates["json"]), statistics.mean(rates["free"])
    print(f"mean: json-schema {j:.1f} tok/s, unconstrained {f:.1f} tok/s, ratio {j / f:.3f} "
          f"({'within' if j >= 0.9 * f else 'NOT within'} 10%)")
    llm.shutdown()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
