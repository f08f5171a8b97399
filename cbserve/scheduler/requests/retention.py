"""A request's retention hints: ranges of its prompt to keep cached at a priority for a while (what they do to the
pool and the tiers: kv/retention.py), checked against the operator's ``RetentionLimits`` at admission."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cbserve.scheduler.config import MAX_RETENTION_PRIORITY, RetentionLimits


@dataclass(frozen=True)
class Retention:
    """One range of a prompt to keep: tokens [start, end), at ``priority`` (1..100), for ``duration_s``."""

    start: int
    end: int
    priority: int
    duration_s: float


def check_retention(ranges: Sequence[Retention], num_prompt_tokens: int, limits: RetentionLimits) -> None:
    """ValueError naming what is wrong with a request's ranges (they are the client's input)."""
    if not ranges:
        return
    if not limits.enabled:
        raise ValueError("retention hints (retention_directives, cache_control) are off on this server "
                         "(kv_retention_max_fraction is 0)")
    for r in ranges:
        if not 0 <= r.start < r.end <= num_prompt_tokens:
            raise ValueError(f"retention range [{r.start}, {r.end}) is not within the prompt's "
                             f"{num_prompt_tokens} tokens")
        if not 1 <= r.priority <= MAX_RETENTION_PRIORITY:
            raise ValueError(f"retention priority must be within 1..{MAX_RETENTION_PRIORITY}, got {r.priority}")
        if not 0 < r.duration_s <= limits.max_duration_s:
            raise ValueError(f"retention duration must be within (0, {limits.max_duration_s:g}] seconds (the "
                             f"server's kv_retention_max_duration_s), got {r.duration_s:g}")


def block_retention(ranges: Sequence[Retention], index: int, block_size: int) -> tuple[int, float]:
    """(priority, duration) of block ``index``: the highest priority and the longest duration among the ranges that
    end after its first token. A range keeps its earlier blocks too: a prefix cache hits a block only with every
    block before it (its ``start`` says which tokens it asks for; those before it come with them)."""
    lo = index * block_size
    priority, duration = 0, 0.0
    for r in ranges:
        if lo < r.end:
            priority, duration = max(priority, r.priority), max(duration, r.duration_s)
    return priority, duration
