"""``cbserve generate``: offline, in-process generation with the ``LLM`` class (no Ray, no HTTP).

Prompts come from ``--prompt`` (repeatable), ``--prompts-file`` (one per line) or standard input. With
``--chat`` each prompt is a user message rendered with the model's chat template. Outputs are printed as
text, or as JSON lines with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from cbserve.scheduler.requests.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or GGUF path (default: bundled SmolLM2)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    parser.add_argument("--chat", action="store_true", help="render each prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: per device)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return prompts


def main(args: argparse.Namespace) -> int:
    from cbserve.frontend.llm import LLM

    prompts = _read_prompts(args)
    if not prompts:
        print("cbserve generate: no prompt given (use --prompt, --prompts-file or standard input)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, n=args.n,
        )
    except ValueError as e:
        print(f"cbserve generate: {e}", file=sys.stderr)
        return 2
    kwargs = {k: v for k, v in (("dtype", args.dtype), ("device", args.device)) if v is not None}
    llm = LLM(model=args.model, **kwargs)
    inputs = [[{"role": "user", "content": p}] for p in prompts] if args.chat else prompts
    start = time.perf_counter()
    outs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in out.outputs
            ]}))
            continue
        for c in out.outputs:
            print(f"--- {prompt!r} [{c.index}] ({c.finish_reason})\n{c.text}")
    log.info("generated %d tokens for %d prompts in %.2f s (%.1f tokens/s)",
             num_tokens, len(prompts), elapsed, num_tokens / max(elapsed, 1e-9))
    return 0
