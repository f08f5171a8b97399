"""LoRA adapters served under their names (vLLM's interface): a request whose ``model`` names an adapter runs
with its ``LoRARequest``; ``/v1/models`` lists the adapters; ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change the set while serving.

Loading here is checking and naming: the adapter is read whole and checked against the model without torch
(``worker/lora/files.py``: a 400 with the reason), its bytes are kept (``lora_contents.py``) and the name gets a
``LoRARequest`` with a fresh id (a new id for every load, so a name loaded again from another path is never
mistaken for the old one) and the digest of those bytes; the workers load exactly them by that id when its first
request arrives, whatever happened to the files since. Unloading only stops new requests: those in flight keep
their ``LoRARequest`` and finish. Served, the adapters' names, ids and bytes are kept once for all ingress
replicas (``cluster/stores/lora_store.py``), each of which mirrors the names and ids here as an ``AdapterSet``.

The routes (``load``, ``unload``) are a client's: off unless the server allows runtime loading (404, as vLLM's
routes that are off), and then only for folders under ``lora_allowed_dirs`` (symlinks resolved). A client learns
nothing of the server's files: a path outside those folders, missing, or not a LoRA adapter all get the one
``NOT_LOADABLE`` 400 (the reason goes to the server log); an adapter that does not fit the model gets its reason.
``add`` and ``check`` are the operator's (``lora_modules``): every reason, paths included.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from cbserve.frontend.lora_contents import KEEP_UNLOADED, AdapterContents
from cbserve.frontend.protocol import APIError
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.worker.loading.model_info import ModelInfo
from cbserve.worker.lora.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterContent,
    AdapterFilesError,
    LoRAAdapterError,
    load_adapter,
)

logger = logging.getLogger(__name__)

NOT_ENABLED = "LoRA is not enabled on this server: start it with enable_lora (--enable-lora)"
_HOW_TO_RUNTIME = ("start the server with allow_runtime_lora_updating and lora_allowed_dirs "
                   "(--allow-runtime-lora-updating --lora-allowed-dirs DIR)")
RUNTIME_OFF = f"Loading and unloading LoRA adapters at run time is off on this server: {_HOW_TO_RUNTIME}"
PUSHED = "pushed:"  # the lora_path of an adapter given as bytes (its workers fetch them by digest, never a path)
NOT_LOADABLE = "lora_path does not name a LoRA adapter this server may load (a PEFT folder under its lora_allowed_dirs)"


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
    """What adapters are checked against: the base model's shape and the largest rank served; ``allowed_dirs``:
    the folders the load route may read adapters from (None: runtime loading is off)."""

    info: ModelInfo
    max_lora_rank: int
    allowed_dirs: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter that passed its checks: the absolute folder it was read from, and what was read."""

    folder: str
    content: AdapterContent


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
    resolves; the load and unload routes are a 404)."""

    def __init__(self, base_name: str, limits: AdapterLimits | None = None, keep_unloaded: int = KEEP_UNLOADED) -> None:
        self.base_name = base_name
        self.limits = limits
        self.contents = AdapterContents(keep_unloaded)  # the bytes of the adapters registered here (not mirrored)
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
        checked = self.check(name, path, replace)
        return self.register(name, checked.folder, replace, checked.content)

    def check(self, name: str, path: str, replace: bool = False) -> CheckedAdapter:
        """The operator's adapter at ``path`` (``lora_modules``) read and checked whole; APIError 400 with every
        reason, its folder included; nothing changes."""
        if self.limits is None:
            raise APIError(400, NOT_ENABLED)
        self._check_name(name, replace)
        if not path:
            raise APIError(400, "lora_path must name the adapter's folder", param="lora_path")
        folder = Path(path).expanduser().absolute()
        try:
            content = load_adapter(folder, self.limits.info, self.limits.max_lora_rank).content
        except LoRAAdapterError as e:
            raise APIError(400, f"adapter {name!r} at {folder}: {e}", param="lora_path") from e
        return CheckedAdapter(str(folder), content)

    def check_content(self, name: str, content: AdapterContent, replace: bool = False) -> CheckedAdapter:
        """A trainer's adapter given as bytes (``rl/adapters.py``; a Serve handle's call, like ``lora_modules`` the
        operator's: no ``lora_allowed_dirs``, no file read), checked whole; APIError 400 with the reason."""
        if self.limits is None:
            raise APIError(400, NOT_ENABLED)
        self._check_name(name, replace)
        try:
            load_adapter(content, self.limits.info, self.limits.max_lora_rank)
        except LoRAAdapterError as e:
            raise APIError(400, f"adapter {name!r}: {e}", param="lora_name") from e
        return CheckedAdapter(f"{PUSHED}{name}", content)

    def check_runtime(self) -> None:
        """The 404 of the load and unload routes where the server does not allow them (see the module)."""
        if self.limits is None:
            raise APIError(404, f"{NOT_ENABLED}; to load adapters at run time, also {_HOW_TO_RUNTIME}",
                           "NotFoundError")
        if self.limits.allowed_dirs is None:
            raise APIError(404, RUNTIME_OFF, "NotFoundError")

    def check_load(self, req: LoadLoRAAdapterRequest) -> CheckedAdapter:
        """A client's ``/v1/load_lora_adapter``: its adapter read from under ``lora_allowed_dirs`` and checked;
        an APIError otherwise (one 400 for any folder it may not have, see the module); nothing changes."""
        self.check_runtime()
        assert self.limits is not None and self.limits.allowed_dirs is not None
        self._check_name(req.lora_name, req.load_inplace)
        folder, why = _allowed_folder(req.lora_path, self.limits.allowed_dirs)
        try:
            if folder is None:
                raise AdapterFilesError(why)
            content = load_adapter(folder, self.limits.info, self.limits.max_lora_rank).content
        except AdapterFilesError as e:
            logger.warning("LoRA adapter %r refused: lora_path %r: %s", req.lora_name, req.lora_path, e)
            raise APIError(400, NOT_LOADABLE, param="lora_path") from e
        except LoRAAdapterError as e:
            logger.warning("LoRA adapter %r refused: %s: %s", req.lora_name, folder, e)
            raise APIError(400, f"adapter {req.lora_name!r}: {e}", param="lora_path") from e
        return CheckedAdapter(str(folder), content)

    def _check_name(self, name: str, replace: bool) -> None:
        if not name or name != name.strip():
            raise APIError(400, f"lora_name {name!r} must be a non-empty name without surrounding spaces",
                           param="lora_name")
        if name == self.base_name:
            raise APIError(400, f"lora_name {name!r} is the served model's name", param="lora_name")
        if name in self._adapters and not replace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")

    def register(self, name: str, folder: str, replace: bool = False,
                 content: AdapterContent | None = None) -> LoRARequest:
        """Serve the adapter in ``folder`` (checked already) as ``name``, with a new id and ``content``'s digest
        (its bytes kept here; None: the workers read the folder); APIError 400 when the name is taken and not
        ``replace``."""
        self._check_name(name, replace)
        lora = LoRARequest(name, self._next_id, folder, None if content is None else content.digest)
        self._next_id += 1
        if content is not None:
            self.contents.add(content)
        old = self._adapters.pop(name, None)  # a replaced adapter moves to the end of the list
        if old is not None and old.digest is not None:
            self.contents.release(old.digest)
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
        if lora.digest is not None:
            self.contents.release(lora.digest)
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
        checked = self.check_load(req)
        self.register(req.lora_name, checked.folder, req.load_inplace, checked.content)
        return loaded_message(req.lora_name)

    def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        self.check_runtime()
        self.remove(req.lora_name, req.lora_int_id)
        return unloaded_message(req.lora_name)


def _allowed_folder(path: str, allowed_dirs: tuple[str, ...]) -> tuple[Path | None, str]:
    """``path`` with its symlinks resolved when it and the adapter's files in it lie under one of
    ``allowed_dirs`` (theirs resolved too), else None; and why not (for the server log)."""
    try:
        dirs = [Path(os.path.realpath(d)) for d in allowed_dirs]
        folder = Path(os.path.realpath(path)) if path else None
        if folder is None or not any(folder.is_relative_to(d) for d in dirs):
            return None, f"{path!r} is not under lora_allowed_dirs {list(allowed_dirs)}"
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            target = Path(os.path.realpath(folder / name))
            if not any(target.is_relative_to(d) for d in dirs):
                return None, f"{folder / name} leads to {target}, outside lora_allowed_dirs {list(allowed_dirs)}"
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        return None, f"{path!r} cannot be resolved: {e}"
    return folder, ""
