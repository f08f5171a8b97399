"""cbserve: LLM serving on Ray with iteration-level batching, a paged KV cache and selective batching.

``from cbserve import LLM, SamplingParams`` (and ``LoRARequest`` for adapters). LLM is imported lazily so
that ``cbserve.scheduler`` stays importable without torch or ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec

if TYPE_CHECKING:
    from cbserve.frontend.llm import LLM

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredSpec"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name == "LLM":
        from cbserve.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'cbserve' has no attribute {name!r}")
