"""The pooling runner's last step (``runner: pooling``): the final hidden states of a request's prompt (after the
model's final norm) become one embedding (``pooling_config.py`` says how).

A prompt may be computed in several chunks (chunked prefill): what a chunk contributes is kept in the
request's worker state (``CachedRequestState.pooled``: the sum for mean pooling, the running maximum for max,
the first token's state for CLS) and the vector is finished at the step that completes the prompt. A request
recomputed after preemption comes back as a new request, so its state starts over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from cbserve.worker.loading.pooling_config import PoolingConfig
from cbserve.worker.runner.input_batch import CachedRequestState


class Pooler:
    """``norm``: the model's final norm (rows in, normed rows out)."""

    def __init__(self, config: PoolingConfig, norm: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.config = config
        self.norm = norm

    def __call__(
        self, hidden: torch.Tensor, states: Sequence[CachedRequestState], query_lens: Sequence[int]
    ) -> dict[str, list[float]]:
        """Pool one step: ``hidden`` holds the step's rows, ``query_lens[i]`` of them for ``states[i]`` (in that
        order; its ``num_computed_tokens`` not yet advanced). Returns the embeddings of the requests whose prompt
        this step completes, by request id."""
        kind = self.config.pooling_type
        if kind in ("last", "cls"):
            self._pick_rows(hidden, states, query_lens, kind == "last")
        else:
            rows = self.norm(hidden).float()
            for s, part in zip(states, torch.split(rows, list(query_lens)), strict=True):
                step = part.sum(0) if kind == "mean" else part.amax(0)
                if s.pooled is None or s.num_computed_tokens == 0:
                    s.pooled = step
                else:
                    s.pooled = s.pooled + step if kind == "mean" else torch.maximum(s.pooled, step)
        done = [s for s, n in zip(states, query_lens, strict=True) if s.num_computed_tokens + n >= s.num_prompt_tokens]
        if not done:
            return {}
        vectors = torch.stack([s.pooled for s in done])  # type: ignore[misc]
        if kind == "mean":
            counts = torch.tensor([s.num_prompt_tokens for s in done], dtype=vectors.dtype, device=vectors.device)
            vectors = vectors / counts.unsqueeze(1)
        if self.config.normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        return {s.req_id: v for s, v in zip(done, vectors.tolist(), strict=True)}

    def _pick_rows(
        self, hidden: torch.Tensor, states: Sequence[CachedRequestState], query_lens: Sequence[int], last: bool
    ) -> None:
        """Last-token pooling keeps the row of a prompt's last token, CLS the row of its first."""
        picked: list[CachedRequestState] = []
        rows: list[int] = []
        first = 0
        for s, n in zip(states, query_lens, strict=True):
            start = s.num_computed_tokens
            if (start + n >= s.num_prompt_tokens) if last else start == 0:
                picked.append(s)
                rows.append(first + n - 1 if last else first)
            first += n
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        normed = self.norm(hidden.index_select(0, index)).float()
        for s, row in zip(picked, normed, strict=True):
            s.pooled = row
