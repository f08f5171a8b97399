"""Engine core: requests, paged KV block management, the iteration-level scheduler. Standard library only."""

from .sampling_params import SamplingParams

__all__ = ["SamplingParams"]
