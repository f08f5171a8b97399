"""The stop rule: the one place that decides whether a sequence stops after a token, and why.

After a token is appended, a sequence of ``num_tokens`` tokens (prompt + output) stops with

- "stop" when the token is EOS (unless ``ignore_eos``) or one of ``stop_token_ids``, but only once more
  than ``min_tokens`` tokens were generated (the worker masks those tokens before that, too);
- "length" when it reached ``max_len``: prompt + ``max_tokens``, never more than ``max_model_len``.

Sampling, n > 1 forks and beam search all ask ``StopRule.check``. Stop strings are the front end's
business (its detokenizer calls ``EngineCore.finish_request``); aborts come from outside too.
"""

from __future__ import annotations

from dataclasses import dataclass

from cbserve.scheduler.requests.request import RequestStatus
from cbserve.scheduler.requests.sampling_params import SamplingParams

STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH = RequestStatus.FINISHED_LENGTH


@dataclass(frozen=True, slots=True)
class StopRule:
    """The stop conditions of one request, precomputed for the per-token hot path."""

    max_len: int  # "length" once a sequence holds this many tokens
    min_stop_len: int  # EOS / stop token ids count only in a sequence longer than this
    eos_token_id: int | None  # None when ignore_eos (or the model has none)
    stop_token_ids: frozenset[int]

    @classmethod
    def for_request(
        cls,
        params: SamplingParams,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> StopRule:
        """``max_tokens`` is the resolved one (limits.resolve_max_tokens), never None."""
        return cls(
            max_len=min(num_prompt_tokens + max_tokens, max_model_len),
            min_stop_len=num_prompt_tokens + params.min_tokens,
            eos_token_id=None if params.ignore_eos else eos_token_id,
            stop_token_ids=frozenset(params.stop_token_ids),
        )

    def room(self, num_tokens: int) -> int:
        """Tokens a sequence of ``num_tokens`` tokens may still get before it reaches its length limit."""
        return self.max_len - num_tokens

    def check(self, num_tokens: int, token: int) -> RequestStatus | None:
        """Does a sequence of ``num_tokens`` tokens whose last one is ``token`` stop, and why:
        FINISHED_STOPPED, FINISHED_LENGTH or None (it goes on)."""
        if num_tokens > self.min_stop_len and (token == self.eos_token_id or token in self.stop_token_ids):
            return STOPPED
        if num_tokens >= self.max_len:
            return LENGTH
        return None
