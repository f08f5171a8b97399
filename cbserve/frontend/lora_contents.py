"""The checked bytes of LoRA adapters, kept so that the workers run exactly what was checked (an adapter's
files may change or go once it is loaded; ``worker/lora/files.py`` reads and checks them, ``LoRARequest.digest``
names them).

- ``AdapterContents``: contents by digest, those of the adapters served (one copy for every name that serves
  the same bytes) and, once unloaded, the last ``keep_unloaded`` of them: a request admitted before its adapter
  was unloaded may still need its worker to load it. Bounded: the adapters served plus that many. The app's
  store keeps one for all its engines (``cluster/stores/lora_store.py``), the registry of a replica without Ray too.
- ``LocalAdapters``: the offline ``LLM``'s adapters, each ``LoRARequest`` it is given checked once and kept
  with its bytes in its process; called with a request, it is the worker's source (``LoRAManager.source``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.worker.loading.model_info import ModelInfo
from cbserve.worker.lora.files import AdapterContent, LoRAAdapterError, load_adapter

KEEP_UNLOADED = 16  # unloaded adapters whose bytes are kept for the requests still running with them


class AdapterContents:
    """Checked adapter contents by digest (see the module docstring)."""

    def __init__(self, keep_unloaded: int = KEEP_UNLOADED) -> None:
        self.keep_unloaded = keep_unloaded
        self._contents: dict[str, AdapterContent] = {}
        self._users: dict[str, int] = {}  # digest -> adapters served with it
        self._unloaded: OrderedDict[str, None] = OrderedDict()  # digests no adapter serves, oldest first

    def add(self, content: AdapterContent) -> None:
        """One more adapter serves ``content``."""
        digest = content.digest
        self._contents.setdefault(digest, content)
        self._users[digest] = self._users.get(digest, 0) + 1
        self._unloaded.pop(digest, None)

    def release(self, digest: str) -> None:
        """One adapter serving ``digest`` less: the last one's bytes join the unloaded ones kept."""
        users = self._users.pop(digest, 0) - 1
        if users > 0:
            self._users[digest] = users
            return
        if digest not in self._contents:
            return
        self._unloaded[digest] = None
        while len(self._unloaded) > self.keep_unloaded:
            oldest, _ = self._unloaded.popitem(last=False)
            del self._contents[oldest]

    def get(self, digest: str) -> AdapterContent | None:
        return self._contents.get(digest)

    def __len__(self) -> int:
        return len(self._contents)

    def __contains__(self, digest: object) -> bool:
        return digest in self._contents


class LocalAdapters:
    """The offline ``LLM``'s adapters: ``check`` reads and checks each ``LoRARequest`` whole once and gives it its
    content's digest; the bytes stay here, and ``__call__`` hands them to the worker. The last ``keep`` adapters
    stay checked (given again, one is not read again); those of one ``check`` call always do."""

    def __init__(self, info: ModelInfo, max_lora_rank: int, keep: int) -> None:
        self.info, self.max_lora_rank, self.keep = info, max_lora_rank, keep
        self.contents = AdapterContents(keep_unloaded=0)
        self._checked: OrderedDict[LoRARequest, LoRARequest] = OrderedDict()  # as given -> with its digest

    def check(self, loras: Iterable[LoRARequest]) -> dict[LoRARequest, LoRARequest]:
        """Each adapter as given -> as it runs (its digest set); LoRAAdapterError names the first bad one."""
        out: dict[LoRARequest, LoRARequest] = {}
        for lora in loras:
            checked = self._checked.get(lora)
            if checked is None:
                try:
                    content = load_adapter(lora.lora_path, self.info, self.max_lora_rank).content
                except LoRAAdapterError as e:
                    raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r} at {lora.lora_path}: {e}") from e
                checked = dataclasses.replace(lora, digest=content.digest)
                self.contents.add(content)
                self._checked[lora] = checked
            self._checked.move_to_end(lora)
            out[lora] = checked
        while len(self._checked) > max(self.keep, len(out)):  # the oldest, none of this call's
            _, old = self._checked.popitem(last=False)
            self.contents.release(old.digest or "")
        return out

    def __call__(self, lora: LoRARequest) -> tuple[bytes, bytes]:
        content = self.contents.get(lora.digest or "")
        if content is None:
            raise LoRAAdapterError(f"LoRA adapter {lora.lora_name!r}: no checked content for it in this LLM")
        return content.config, content.weights
