"""A stream continued on another replica: when the engine replica running a request is lost after some of its tokens
were streamed, the request goes on elsewhere as a continuation (failover.py): its prompt followed by the tokens the
client already has, for the tokens it still may generate. The client's stream goes on where it stopped; nothing is
repeated or cut.

Greedy requests continue with exactly the tokens an uninterrupted run gives (the continuation's prompt is that run's
context). A sampled one continues with a fresh sample of the same distribution (a seeded one: from a new seed
stream). What would change the distribution is not continued and ends with the error as before: more than one
sequence (``n``, ``best_of``, beam search: their sequences are forked inside one engine), presence and frequency
penalties (they count the output tokens, which would be prompt tokens now), structured output (its grammar's state
lives in the lost engine).
"""

from __future__ import annotations

from dataclasses import replace

from cbserve.scheduler.requests.request import EngineRequest


def why_not_continued(request: EngineRequest) -> str | None:
    """Why ``request`` cannot be continued on another replica (None: it can)."""
    sp = request.sampling_params
    if sp.num_sequences != 1 or sp.use_beam_search:
        return "it has several sequences (n, best_of or beam search)"
    if sp.presence_penalty or sp.frequency_penalty:
        return "presence and frequency penalties count its output tokens"
    if sp.structured is not None:
        return "its structured output's grammar state was on the lost replica"
    return None


def continuation(request: EngineRequest, generated: list[int]) -> EngineRequest:
    """``request`` after ``generated`` tokens: those appended to its prompt, its token bounds lowered by as many (its
    prompt logprobs were sent already)."""
    sp, k = request.sampling_params, len(generated)
    params = replace(sp, max_tokens=None if sp.max_tokens is None else sp.max_tokens - k,
                     min_tokens=max(0, sp.min_tokens - k), prompt_logprobs=None)  # fmt: skip
    return replace(request, prompt_token_ids=list(request.prompt_token_ids) + list(generated), sampling_params=params)
