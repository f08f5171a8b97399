"""Prefill/decode disaggregation's keys (``disaggregation``; ``--pd P:D`` on the CLI).

Two ways to run it:

- One app (``prefill_replicas`` P and ``decode_replicas`` D): P engine replicas are ``kv_producer``s, D are
  ``kv_consumer``s, and the ingress sends a request whose uncached prompt is long enough to a prefill replica first,
  then to a decode replica that pulls its KV (cluster/ingress/disaggregation.py). ``num_replicas`` is P + D.
- Standalone servers driven by a proxy with vLLM's ``kv_transfer_params`` handshake: ``kv_role`` is this server's
  part (``kv_transfer_config``'s ``kv_role`` sets it too: config/kv_config.py).

The KV moves through the RAM tier, which then lives in shared memory (``shm_path``): a 1 GiB tier unless
``kv_offloading_size`` says otherwise. A decode engine maps a producer's file on its own node and gets the blocks of
one on another node through the Ray object store (``transport``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
DEFAULT_TIER_GIB = 1.0


class PDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_replicas: int = Field(0, ge=0)
    decode_replicas: int = Field(0, ge=0)
    kv_role: KVRole = "kv_both"  # this engine's part (set per replica in a P:D app)
    # conditional disaggregation (Dynamo's rule): a prompt with fewer uncached tokens than this is prefilled on its
    # decode replica, and so is every prompt while the prefill replicas' queued prefill tokens exceed the other bound
    min_remote_prefill_tokens: int = Field(256, ge=0)
    max_prefill_queue_tokens: int = Field(65536, ge=1)
    transfer_timeout_s: float = Field(30.0, gt=0)  # how long a producer keeps a request's blocks for its consumer
    pull_wait_s: float = Field(2.0, gt=0)  # how long a consumer waits for a block to be published, then computes it
    shm_path: str = "/dev/shm/cbserve-kv"  # the node's shared folder the producers publish in
    # how a decode engine pulls: "auto" the producer's file when it is on this node, else through the Ray object store
    # (the producer's KVSource actor reads it there); "shm" the file only (another node's prompt is computed); "ray"
    # always the object store. Served engines only: the offline LLM has shared memory alone
    transport: Literal["auto", "shm", "ray"] = "auto"
    # a P:D app's torch threads per side (None: worker_torch_threads): a node's cores split unevenly between the sides,
    # together within its cores (a core shared by both sides stalls both: docs/deployment.md, "Sizing P:D")
    prefill_torch_threads: int | None = Field(None, ge=1)
    decode_torch_threads: int | None = Field(None, ge=1)

    @property
    def layout(self) -> bool:
        return self.prefill_replicas + self.decode_replicas > 0

    def role_of(self, replica: int) -> KVRole:
        if not self.layout:
            return self.kv_role
        return "kv_producer" if replica < self.prefill_replicas else "kv_consumer"


def parse_pd(value: Any) -> Any:
    """``"P:D"`` (the CLI's ``--pd``) or a JSON object, as the field's dict."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null"):
            return None
        if ":" in text and not text.startswith("{"):
            p, _, d = text.partition(":")
            try:
                return {"prefill_replicas": int(p), "decode_replicas": int(d)}
            except ValueError as e:
                raise ValueError(f"--pd takes P:D (prefill and decode replicas), got {value!r}") from e
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"disaggregation is not valid JSON or P:D: {e}") from e
    return value


def apply_layout(values: Any) -> Any:
    """A config's raw values with what disaggregation implies: ``num_replicas`` P + D (another value: ValueError) and
    a RAM tier for the hand-off."""
    if not isinstance(values, dict) or values.get("disaggregation") in (None, "", "none", "null"):
        return values
    pd = PDConfig.model_validate(parse_pd(values["disaggregation"]))
    out = {**values, "disaggregation": pd}
    if pd.layout:
        if pd.prefill_replicas < 1 or pd.decode_replicas < 1:
            raise ValueError(f"--pd {pd.prefill_replicas}:{pd.decode_replicas}: a P:D app needs at least one prefill "
                             "and one decode replica")
        given = values.get("num_replicas")
        if given is not None and int(given) != pd.prefill_replicas + pd.decode_replicas:
            raise ValueError(f"num_replicas {given} disagrees with --pd {pd.prefill_replicas}:{pd.decode_replicas} "
                             "(a P:D app has P + D engine replicas): give one")
        out["num_replicas"] = pd.prefill_replicas + pd.decode_replicas
    if values.get("kv_offloading_size") in (None, "", "none", "null"):
        out["kv_offloading_size"] = DEFAULT_TIER_GIB
    return out


def check_pd_keys(config: Any) -> None:
    """ValueError where disaggregation cannot run as configured (of a ``CBServeConfig``)."""
    pd = config.disaggregation
    if pd is None:
        return
    if config.kv_offloading_dtype == "int8":
        raise ValueError("disaggregation hands blocks over in the RAM tier's dtype: kv_offloading_dtype 'int8' keeps "
                         "scales beside them, not shared yet; use 'auto' or 'bfloat16'")
    if not pd.layout and (pd.prefill_torch_threads or pd.decode_torch_threads):
        raise ValueError("prefill_torch_threads and decode_torch_threads size the sides of a P:D app (--pd P:D); a "
                         "standalone kv_role server has worker_torch_threads")
    if pd.layout and config.autoscaling is not None:
        raise ValueError("a P:D app (--pd) sets its replicas itself: it does not combine with autoscaling yet")


def worker_fields(pd: PDConfig | None) -> dict[str, Any]:
    """The worker's ``ModelConfig`` fields of an engine's part (worker/kv/shared.py)."""
    if pd is None:
        return {}
    return {"kv_role": pd.kv_role, "kv_shm_path": pd.shm_path, "kv_transfer_timeout_s": pd.transfer_timeout_s,
            "kv_pull_wait_s": pd.pull_wait_s, "kv_transport": pd.transport}


def config_for_replica(config: Any, replica: int) -> Any:
    """A ``CBServeConfig`` as replica ``replica`` of a P:D app runs it (its role); the config itself otherwise."""
    pd = config.disaggregation
    if pd is None or not pd.layout:
        return config
    role = pd.role_of(replica)
    threads = pd.prefill_torch_threads if role == "kv_producer" else pd.decode_torch_threads
    return config.model_copy(update={"disaggregation": pd.model_copy(update={"kv_role": role}),
                                     "worker_torch_threads": threads or config.worker_torch_threads})
