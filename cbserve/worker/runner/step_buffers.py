"""The host side of a step's inputs: staged in one host buffer reused between steps, copied to the device at once.

The step's input arrays (token ids, positions, slot mapping, block tables, lengths, row offsets, sampled rows)
are written one after another into a byte buffer and reach the device in one copy; each input is a view of
that copy with its own dtype and shape. On CUDA the buffer is pinned and the copy ``non_blocking``, so the
host goes on while it runs. A pinned buffer must not be overwritten while an earlier copy from it may still
be in flight: there are two buffers, used in turn, and each records an event after its copy, which the step
that reuses it (two steps later) waits on; by then the copy has long finished, so the wait costs nothing.
On the CPU the step's arrays are the tensors themselves (``torch.from_numpy``: each step's arrays are new,
so nothing aliases an earlier step): staging there would only add a copy and a dozen torch calls, which cost
more than the rest of the step's preparation. Tests stage on the CPU (``copy=True``, no pinning, stand-in
events) to run the CUDA path's logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

_ALIGN = 64  # bytes: every input starts on its own cache line
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                 np.dtype(np.float32): torch.float32}


class _Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


def _cuda_event() -> _Event:
    return torch.cuda.Event()


class StepBuffers:
    """``stage(arrays)`` returns the device tensors of one step's inputs (new int32, int64 or float32 arrays).

    ``copy``: stage and copy (default: off the CPU). ``pin``: a pinned buffer and an asynchronous copy (default:
    on a CUDA device). ``new_event``: what records the end of a buffer's copy (``torch.cuda.Event`` when
    pinned; a stand-in in tests)."""

    def __init__(self, device: torch.device, pin: bool | None = None,
                 new_event: Callable[[], _Event] | None = None, copy: bool | None = None) -> None:
        self.device = device
        self.copy = device.type != "cpu" if copy is None else copy
        self.pin = device.type == "cuda" if pin is None else pin
        self._new_event = new_event if new_event is not None else (_cuda_event if self.pin else None)
        self._hosts: list[torch.Tensor | None] = [None, None]
        self._events: list[_Event | None] = [None, None]
        self._current = 1

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Write ``arrays`` into the next host buffer, copy it to the device, return each array's device view
        (without ``copy``: each array as a tensor)."""
        if not self.copy:
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        host = self._next_host(max(total, _ALIGN))
        host_np = host.numpy()
        for a, at in zip(arrays, offsets, strict=True):
            host_np[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        dev.copy_(host[:total], non_blocking=self.pin)
        if self._new_event is not None:
            event = self._new_event()
            event.record()
            self._events[self._current] = event
        typed = {dt: dev.view(_TORCH_DTYPES[dt]) for dt in {a.dtype for a in arrays}}
        out = []
        for a, at in zip(arrays, offsets, strict=True):
            first = at // a.itemsize
            view = typed[a.dtype][first : first + a.size]
            out.append(view if a.ndim == 1 else view.view(a.shape))
        return out

    def _next_host(self, size: int) -> torch.Tensor:
        """The other host buffer, once its last copy is done, grown to a power of two that holds ``size`` bytes."""
        self._current ^= 1
        event = self._events[self._current]
        if event is not None:
            event.synchronize()  # this buffer's copy of two steps ago is done: it may be written
            self._events[self._current] = None
        host = self._hosts[self._current]
        if host is None or host.numel() < size:
            host = torch.empty(1 << (size - 1).bit_length(), dtype=torch.uint8, pin_memory=self.pin)
            self._hosts[self._current] = host
        return host
