"""A request's part in prefill/decode disaggregation: vLLM's ``kv_transfer_params`` handshake, read and written.

A proxy (vLLM's, or cbserve's own ingress: cluster/ingress/disaggregation.py) sends a request to a prefill engine
with ``{"do_remote_decode": true}``: that engine (a ``kv_producer``) computes the prompt, keeps its KV blocks
published in its shared-memory tier for ``transfer_timeout_s`` and answers with the parameters a decode engine needs
(``published``). The proxy sends the same request to a decode engine (a ``kv_consumer``) with those parameters
(``do_remote_prefill``): it pulls the published blocks (scheduler/kv/offload.py, worker/kv/shared.py), computes the
prompt's last tokens itself and streams the rest (from a producer on another node through the Ray object store:
cluster/engine/kv_source.py). A block that cannot be pulled (the producer is gone, its tier was overwritten) is
computed: a request is never lost to the hand-off.

Only the keys below are accepted; ``remote_engine_id`` names a file of the shared folder, so it is checked as a
name (letters, digits, ``.``, ``_``, ``-``), never used as a path.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

KEYS = frozenset({"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
                  "remote_port", "remote_request_id", "tp_size"})  # fmt: skip
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
MAX_BLOCKS = 1 << 20


@dataclass(frozen=True)
class KVTransferParams:
    """``remote_decode``: prefill here and publish the prompt's KV for a decode engine. ``remote_engine``: the
    producer whose published blocks hold this prompt's first ``remote_blocks`` blocks (pull them, compute the rest)."""

    remote_decode: bool = False
    remote_engine: str | None = None
    remote_blocks: int = 0
    answer: dict[str, Any] | None = None  # a producer's engine sets what it answers (``published``) at admission

    @classmethod
    def from_json(cls, raw: Any) -> KVTransferParams | None:
        """The request field (a JSON object), checked; None when it asks for nothing. ValueError names what is wrong."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"kv_transfer_params must be a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - KEYS)
        if unknown:
            raise ValueError(f"kv_transfer_params: unknown key(s) {unknown}; accepted: {sorted(KEYS)}")
        decode, prefill = bool(raw.get("do_remote_decode")), bool(raw.get("do_remote_prefill"))
        if decode and prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive (one engine "
                             "prefills, the other decodes)")
        if not prefill:
            return cls(remote_decode=True) if decode else None
        engine, blocks = raw.get("remote_engine_id"), raw.get("remote_block_ids")
        if not isinstance(engine, str) or not _NAME.fullmatch(engine):
            raise ValueError(f"kv_transfer_params: remote_engine_id must be the name a prefill engine answered "
                             f"(letters, digits, '.', '_', '-'), got {engine!r}")
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks) \
                or len(blocks) > MAX_BLOCKS:  # fmt: skip
            raise ValueError("kv_transfer_params: remote_block_ids must be the list of block ids a prefill engine "
                             "answered")
        return cls(remote_engine=engine, remote_blocks=len(blocks))

    def published(self, engine: str, num_prompt_tokens: int, block_size: int) -> dict[str, Any]:
        """What a producer answers for a ``remote_decode`` request: the prompt's full blocks but the one holding its
        last token (a decode engine computes that token itself), under ``engine``'s name on this host."""
        num_blocks = max(0, (num_prompt_tokens - 1) // block_size)
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine,
                "remote_block_ids": list(range(num_blocks)), "remote_host": socket.gethostname(), "remote_port": 0}
