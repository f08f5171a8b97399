"""LoRA adapters served under their names (vLLM's interface): a request whose ``model`` names an adapter runs
with its ``LoRARequest``; ``/v1/models`` lists the adapters; ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change the set while serving.

Loading here is checking and naming: the adapter's files are read and checked against the model without
torch (``worker/lora_files.py``: a 400 with the reason), and the name gets a ``LoRARequest`` with a fresh id
(a new id for every load, so a name loaded again from another path is never mistaken for the old one); the
workers load the weights by that id when its first request arrives. Unloading only stops new requests:
those in flight keep their ``LoRARequest`` and finish. Served, the adapters' names and ids are kept once for all
ingress replicas (``cluster/lora_store.py``), each of which mirrors them here as an ``AdapterSet``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cbserve.scheduler.lora import LoRARequest
from cbserve.worker.lora_files import LoRAAdapterError, check_adapter, read_adapter
from cbserve.worker.model_info import ModelInfo

from .protocol import APIError

NOT_ENABLED = "LoRA is not enabled on this server: start it with enable_lora (--enable-lora)"


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``. ``load_inplace``: replace an adapter already loaded under the name."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``. ``lora_int_id``: when given, the loaded adapter's id must be it."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


@dataclass(frozen=True)
class AdapterSet:
    """The adapters served at one ``version`` (it grows with every load and unload), in the order loaded, and
    the id the next load gets: what the shared store hands every ingress replica."""

    version: int
    adapters: tuple[LoRARequest, ...]
    next_id: int


@dataclass(frozen=True)
class AdapterLimits:
    """What adapters are checked against: the base model's shape and the largest rank served."""

    info: ModelInfo
    max_lora_rank: int


def not_found(model: str) -> APIError:
    """The 404 of a ``model`` that is neither the served model nor a loaded adapter."""
    return APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def loaded_message(name: str) -> str:
    """vLLM's answer to a load (the route answers it as text)."""
    return f"Success: LoRA adapter '{name}' added successfully."


def unloaded_message(name: str) -> str:
    return f"Success: LoRA adapter '{name}' removed successfully."


class LoRARegistry:
    """The adapters of one ingress replica, by name. ``limits`` None: LoRA is off (only the base model's name
    resolves; loading is a 400)."""

    def __init__(self, base_name: str, limits: AdapterLimits | None = None) -> None:
        self.base_name = base_name
        self.limits = limits
        self._adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self.version = 0  # one more with every change

    @property
    def enabled(self) -> bool:
        return self.limits is not None

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name); a 404 naming it
        otherwise."""
        if model is None or model == self.base_name:
            return None
        lora = self._adapters.get(model)
        if lora is None:
            raise not_found(model)
        return lora

    def adapters(self) -> list[LoRARequest]:
        """The loaded adapters, in the order they were loaded."""
        return list(self._adapters.values())

    def add(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Check the adapter at ``path`` and serve it as ``name`` (APIError 400 with the reason otherwise)."""
        return self.register(name, self.check(name, path, replace), replace)

    def check(self, name: str, path: str, replace: bool = False) -> str:
        """The absolute folder of the adapter at ``path`` once its name and files pass (APIError 400 with the
        reason otherwise); nothing changes."""
        if self.limits is None:
            raise APIError(400, NOT_ENABLED)
        self._check_name(name, replace)
        if not path:
            raise APIError(400, "lora_path must name the adapter's folder", param="lora_path")
        folder = Path(path).expanduser().absolute()
        try:
            check_adapter(read_adapter(folder), self.limits.info, self.limits.max_lora_rank)
        except LoRAAdapterError as e:
            raise APIError(400, f"adapter {name!r}: {e}", param="lora_path") from e
        return str(folder)

    def _check_name(self, name: str, replace: bool) -> None:
        if not name or name != name.strip():
            raise APIError(400, f"lora_name {name!r} must be a non-empty name without surrounding spaces",
                           param="lora_name")
        if name == self.base_name:
            raise APIError(400, f"lora_name {name!r} is the served model's name", param="lora_name")
        if name in self._adapters and not replace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")

    def register(self, name: str, folder: str, replace: bool = False) -> LoRARequest:
        """Serve the adapter in ``folder`` (checked already) as ``name``, with a new id (APIError 400 when the
        name is taken and not ``replace``)."""
        self._check_name(name, replace)
        lora = LoRARequest(name, self._next_id, folder)
        self._next_id += 1
        self._adapters.pop(name, None)  # a replaced adapter moves to the end of the list
        self._adapters[name] = lora
        self.version += 1
        return lora

    def remove(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving ``name`` (requests in flight finish with it); a 404 when it is not loaded."""
        if self.limits is None:
            raise APIError(400, NOT_ENABLED)
        return self.unregister(name, lora_int_id)

    def unregister(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        """``remove`` without asking whether LoRA is on (the shared store's bookkeeping)."""
        lora = self._adapters.get(name)
        if lora is None or (lora_int_id is not None and lora.lora_int_id != lora_int_id):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
        del self._adapters[name]
        self.version += 1
        return lora

    def snapshot(self) -> AdapterSet:
        return AdapterSet(self.version, tuple(self._adapters.values()), self._next_id)

    def apply(self, adapters: AdapterSet) -> bool:
        """Mirror ``adapters`` when they are newer than what is served here; whether they were."""
        if adapters.version <= self.version:
            return False
        self._adapters = {lora.lora_name: lora for lora in adapters.adapters}
        self.version, self._next_id = adapters.version, adapters.next_id
        return True

    # ---- the routes' bodies ---------------------------------------------------------------------
    def load(self, req: LoadLoRAAdapterRequest) -> str:
        """``/v1/load_lora_adapter``: vLLM's success message (the route answers it as text)."""
        self.add(req.lora_name, req.lora_path, replace=req.load_inplace)
        return loaded_message(req.lora_name)

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        self.remove(req.lora_name, req.lora_int_id)
        return unloaded_message(req.lora_name)
