"""Request sets for ``cbserve bench``: a seeded random workload and ShareGPT-format JSON files.

The random workload builds prompts from common English words, each of which is a single token (with its
leading space) in the byte-level BPE vocabularies of the Llama / SmolLM / GPT-2 families, so a prompt of
``k`` words is ``k`` tokens give or take a template. Exact token counts come back in the server's usage.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Checked against the SmolLM2 tokenizer: every word is one token with a leading space.
WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
    "his", "her", "they", "this", "which", "you", "have", "had", "are", "not", "but", "be", "one",
    "all", "were", "we", "when", "there", "can", "an", "more", "their", "so", "what", "about", "if",
    "out", "up", "into", "some", "would", "other", "time", "only", "new", "them", "people", "two",
    "may", "first", "after", "like", "than", "its", "also", "over", "these", "many", "any", "such",
    "used", "most", "where", "made", "before", "well", "through", "back", "years", "much", "very",
    "three", "way", "down", "should", "work", "because", "each", "just", "those", "our", "world",
    "still", "life", "being", "know", "between", "day", "under", "both", "long", "last", "great", "own",
    "while", "might", "same", "another", "state", "part", "never", "around", "found", "place", "year",
    "often", "since", "against", "end", "become", "without", "during", "high", "city", "small", "again",
    "water", "school", "however", "every", "take", "number", "large", "called", "name", "home",
    "system", "later", "until", "good", "given", "left", "us", "although", "must", "within", "war",
    "man", "use", "case", "form", "four", "power", "family", "children", "fact", "point", "local",
    "early", "days", "order", "set", "went", "along", "government", "need", "best", "following",
    "house", "told",
)


@dataclass(frozen=True)
class SampleRequest:
    """One request to send: a prompt, its (estimated) length in tokens and the output length asked for."""

    prompt: str
    prompt_len: int
    output_len: int


def parse_range(text: str | int | Sequence[int]) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"64:256"`` or ``"64-256"`` -> (64, 256); ints and pairs pass through."""
    if isinstance(text, int):
        lo = hi = text
    elif isinstance(text, str):
        parts = text.replace("-", ":").split(":")
        if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"expected N or LO:HI with non-negative integers, got {text!r}")
        lo, hi = int(parts[0]), int(parts[-1])
    else:
        lo, hi = (int(v) for v in text)
    if lo < 0 or hi < lo:
        raise ValueError(f"bad range {lo}:{hi} (need 0 <= LO <= HI)")
    return lo, hi


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sample_random(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    shared_prefix_len: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` prompts of ``shared_prefix_len`` common words followed by a uniformly drawn number
    (in ``input_len``, inclusive) of random words; output lengths drawn uniformly from ``output_len``.
    The same arguments always give the same requests."""
    if num_prompts < 0 or shared_prefix_len < 0:
        raise ValueError("num_prompts and shared_prefix_len must be >= 0")
    if output_len[0] < 1:
        raise ValueError("output lengths must be >= 1")
    rng = random.Random(seed)
    prefix = random_words(rng, shared_prefix_len)
    out: list[SampleRequest] = []
    for _ in range(num_prompts):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        # The first word differs from the prefix's stream, so private parts never share a cached block.
        body = random_words(rng, n_in)
        prompt = f"{prefix} {body}".strip() if prefix else body
        out.append(SampleRequest(prompt=prompt, prompt_len=shared_prefix_len + n_in, output_len=n_out))
    return out


def estimate_tokens(text: str) -> int:
    """A rough token count (~4 characters per token) for datasets without a tokenizer at hand."""
    return max(1, round(len(text) / 4))


def load_sharegpt(
    path: str | Path,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    max_prompt_len: int = 1024,
    max_output_len: int = 1024,
) -> list[SampleRequest]:
    """Conversations from a ShareGPT-format JSON file (a list of ``{"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}``): the first human turn is the prompt and the
    length of the reply that follows sets the output length (unless ``output_len`` fixes it). Entries are
    shuffled with ``seed``; too short or too long ones are skipped."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rng = random.Random(seed)
    order = list(range(len(data)))
    rng.shuffle(order)
    out: list[SampleRequest] = []
    for i in order:
        if len(out) >= num_prompts:
            break
        pair = _first_exchange(data[i])
        if pair is None:
            continue
        prompt, reply = pair
        p_len = estimate_tokens(prompt)
        o_len = output_len if output_len is not None else estimate_tokens(reply)
        if p_len < 4 or o_len < 1 or p_len > max_prompt_len or o_len > max_output_len:
            continue
        out.append(SampleRequest(prompt=prompt, prompt_len=p_len, output_len=o_len))
    if len(out) < num_prompts:
        raise ValueError(f"{path}: only {len(out)} usable conversations, {num_prompts} asked for")
    return out


def _first_exchange(entry: object) -> tuple[str, str] | None:
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations") or entry.get("conversation") or []
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    prompt, reply = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(reply, str) and prompt and reply):
        return None
    return prompt, reply
