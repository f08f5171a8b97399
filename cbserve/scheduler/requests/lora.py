"""LoRA adapters as the engine sees them: which adapter a request runs with (``LoRARequest``, vLLM's name and
fields) and the scheduling rule that a step holds at most ``max_loras`` distinct adapters.

The rule only delays admissions: a waiting request whose adapter is not among those of the running
sequences waits while ``max_loras`` others run; a running sequence's adapter is never evicted. Prefix-cache
entries carry the adapter's id (``LoRARequest.cache_keys``), so two adapters never share KV blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoRARequest:
    """One adapter: ``lora_int_id`` (>= 1) identifies it in the engine and the workers' caches (a new path
    for a name gets a new id); ``lora_path`` is a PEFT folder (adapter_config.json + adapter_model.safetensors).
    ``digest`` names the content the front end checked (``sha256:...`` of both files, worker/lora/files.py): a
    worker runs exactly that content, which it gets from its adapter source (served: the app's store; offline:
    the ``LLM``), never a file changed since; None: the worker reads ``lora_path``."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty path, got {self.lora_path!r}")
        if self.digest is not None and (not isinstance(self.digest, str) or not self.digest):
            raise ValueError(f"digest must be None or a non-empty string, got {self.digest!r}")

    @property
    def cache_keys(self) -> tuple:
        """Its part of a request's prefix-cache keys: blocks computed under it are its own."""
        return (("lora", self.lora_int_id),)


def lora_admission(
    running: Iterable[Any], max_loras: int, select: Callable[[Any], bool] | None
) -> Callable[[Any], bool]:
    """An admission filter for one step: a sequence (``seq.group.lora``) is accepted when ``select`` (the
    policy's) accepts it and its adapter is the base model, one already running, or a new one while fewer than
    ``max_loras`` distinct adapters run. Accepting a new adapter counts it for the rest of the step."""
    active = {seq.group.lora.lora_int_id for seq in running if seq.group.lora is not None}

    def accept(seq: Any) -> bool:
        if select is not None and not select(seq):
            return False
        lora = seq.group.lora
        if lora is None or lora.lora_int_id in active:
            return True
        if len(active) >= max_loras:
            return False
        active.add(lora.lora_int_id)
        return True

    return accept
