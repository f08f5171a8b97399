"""The shared-memory hand-off of prefill/decode disaggregation: a producer's RAM tier lives in one file of a shared
folder (``/dev/shm/cbserve-kv`` by default), mapped by every engine of the node that pulls from it.

The file: a header (magic, slot count, one block's shape and dtype), a tag per slot (the hash of the block it holds
as a signed 64-bit number; 0 while the slot is written) and the slots themselves, each laid out as the RAM tier's
``[layers, 2, block_size, kv_heads, head_dim]``. The producer sets a slot's tag to 0 before it writes the slot and
to the block's hash after; a consumer reads the tag, copies the slot into its own RAM tier and reads the tag again:
the copy counts only when both reads give the hash it wants (a slot overwritten meanwhile is a failed pull, and the
block is computed). x86 keeps stores in order and loads in order, which is all this needs; the file is created
with every page touched, so a store never waits for a page fault.

The file's name is the producer's engine id (``remote_engine_id`` in ``kv_transfer_params``): the model's tier key
(the same one the disk tier names its folder by: the model's files, dtype, block size, rank), the process id and a
random suffix, so that a consumer only maps a producer of its own model and layout, and a restarted producer never
reuses a name. The producer deletes its file when it stops; one of a dead process is deleted by the next producer
that starts in the folder (a consumer that still maps it keeps its pages until it lets go).
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cbserve.worker.kv.disk import remove_if_gone

logger = logging.getLogger(__name__)

SUFFIX = ".kvshm"
MAGIC = b"CBKVSHM1"
_HEADER = struct.Struct("<8sQ16s64s")  # magic, slots, dtype name, block shape as text
_ALIGN = 4096
POLL_S = 0.002  # how often a producer's tags are read again while a block is not published yet


def as_tag(h: int) -> int:
    """A block hash (unsigned 64-bit) as the signed number a tag holds (0 is "being written", never a hash here)."""
    h &= (1 << 64) - 1
    return (h - (1 << 64) if h >= 1 << 63 else h) or 1


class SharedSlots:
    """One producer's tier file, mapped: ``slots`` (``[n, *block_shape]``) and ``tags`` (``[n]``, int64)."""

    def __init__(self, path: Path, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 create: bool) -> None:
        self.path, self.num_slots = path, num_slots
        block = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.tags_at = _ALIGN
        self.slots_at = -(-(self.tags_at + 8 * num_slots) // _ALIGN) * _ALIGN
        size = self.slots_at + num_slots * block
        if create:  # the space reserved first: a tmpfs too small fails here, not with a SIGBUS on a later store
            with open(path, "wb") as f:
                f.write(_HEADER.pack(MAGIC, num_slots, str(dtype).encode(), repr(tuple(block_shape)).encode()))
                f.flush()
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                except OSError as e:
                    path.unlink(missing_ok=True)
                    raise OSError(f"the shared KV tier needs {size / 2**20:.0f} MiB in {path.parent} ({e}); give "
                                  "the folder more room (a container's /dev/shm: --shm-size) or lower "
                                  "kv_offloading_size") from e
        elif path.stat().st_size != size:
            raise ValueError(f"{path.name} holds {path.stat().st_size} bytes, not the {size} of this layout")
        raw = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        if create:
            raw[self.tags_at :].zero_()  # every page touched now, none on a store's path
        self.tags = raw[self.tags_at : self.tags_at + 8 * num_slots].view(torch.int64)
        self.tag_values = self.tags.numpy()  # the same memory: one tag read without a tensor's overhead
        self.slots = raw[self.slots_at :].view(dtype).view(num_slots, *block_shape)

    @classmethod
    def open(cls, path: Path, block_shape: tuple[int, ...], dtype: torch.dtype) -> SharedSlots:
        """A producer's file, checked against this engine's layout (ValueError when it differs)."""
        with open(path, "rb") as f:
            magic, n, dtype_name, shape = _HEADER.unpack(f.read(_HEADER.size))
        if magic != MAGIC or dtype_name.rstrip(b"\0").decode() != str(dtype) or \
                shape.rstrip(b"\0").decode() != repr(tuple(block_shape)):  # fmt: skip
            raise ValueError(f"{path.name} is not a tier of this layout ({tuple(block_shape)}, {dtype})")
        return cls(path, n, block_shape, dtype, create=False)

    def index(self) -> dict[int, int]:
        """Tag -> slot of the slots that hold a block now."""
        return {t: i for i, t in enumerate(self.tag_values.tolist()) if t}

    def copy_published(self, hashes: list[int], wait_s: float,
                       take: Callable[[list[int], list[int]], None]) -> list[int]:
        """``take(hashes, slots)`` for the published blocks of ``hashes`` (``slots``: theirs in this file), waiting up
        to ``wait_s`` for those not published yet; the hashes whose copy counts (their tag held the hash before and
        after ``take``), in the order taken."""
        deadline, pending, found = time.monotonic() + wait_s, list(hashes), []
        while pending:
            index = self.index()
            ready = [(h, index[as_tag(h)]) for h in pending if as_tag(h) in index]
            if ready:
                take([h for h, _ in ready], [at for _, at in ready])
                after = self.tag_values[[at for _, at in ready]].tolist()
                found += [h for (h, _), tag in zip(ready, after, strict=True) if tag == as_tag(h)]
            taken = {h for h, _ in ready}
            pending = [h for h in pending if h not in taken] if time.monotonic() < deadline else []
            if pending:
                time.sleep(POLL_S)
        return found

    def read(self, hashes: list[int], wait_s: float, out: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
        """Copies of the published blocks of ``hashes`` (``copy_published``): the hashes copied and their blocks (the
        first rows of ``out`` when given: ``[>= len(hashes), *block_shape]`` of the slots' dtype)."""
        if out is None:
            out = torch.empty((len(hashes), *self.slots.shape[1:]), dtype=self.slots.dtype)
        row: dict[int, int] = {}

        def take(hs: list[int], slots: list[int]) -> None:
            rows = [row.setdefault(h, len(row)) for h in hs]
            copy_rows(out, rows, self.slots, slots)

        found = self.copy_published(hashes, wait_s, take)
        if found == list(row)[: len(found)]:
            return found, out[: len(found)]
        return found, out.index_select(0, torch.tensor([row[h] for h in found], dtype=torch.long))


def copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int]) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for each i: one slice copy per run of rows consecutive on both sides
    (a row alone is a run of one: no gathered temporary, whose fresh pages cost more than the copies' calls)."""
    if not dst_rows:
        return
    starts = [i for i in range(len(dst_rows)) if i == 0 or dst_rows[i] != dst_rows[i - 1] + 1
              or src_rows[i] != src_rows[i - 1] + 1]  # fmt: skip
    for i, end in zip(starts, [*starts[1:], len(dst_rows)], strict=True):
        dst[dst_rows[i] : dst_rows[i] + end - i].copy_(src[src_rows[i] : src_rows[i] + end - i])


def producer_name(key: str) -> str:
    return f"{key}-{os.getpid()}-{secrets.token_hex(3)}"


def remove_dead(folder: Path) -> int:
    """Delete the tier files whose producer process is gone (the pid in the name); how many went."""
    return remove_if_gone(folder.glob(f"*{SUFFIX}"), lambda path: path.stem.rsplit("-", 2)[-2])


class Producers:
    """The producers' files a consumer maps, by name (opened once; a file that is gone or of another layout is
    remembered as missing only until the next pull asks again)."""

    def __init__(self, folder: Path, key: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.folder, self.key, self.block_shape, self.dtype = folder, key, block_shape, dtype
        self.open: dict[str, SharedSlots] = {}

    def local(self, name: str) -> bool:
        """Whether the producer's file is in this node's folder (a producer on another node: it is not)."""
        return name in self.open or (self.folder / f"{name}{SUFFIX}").exists()

    def same_model(self, name: str) -> bool:
        """Whether the producer serves this engine's model and layout (its name starts with the tier key; logged
        when not)."""
        if name.startswith(self.key + "-"):
            return True
        logger.warning("KV pull: producer %s serves another model or layout (this engine's key is %s)", name, self.key)
        return False

    def get(self, name: str) -> SharedSlots | None:
        slots = self.open.get(name)
        if slots is not None:
            return slots
        if not self.same_model(name):
            return None
        try:
            slots = self.open[name] = SharedSlots.open(self.folder / f"{name}{SUFFIX}", self.block_shape, self.dtype)
        except (OSError, ValueError) as e:
            logger.warning("KV pull: producer %s cannot be mapped (%s); its blocks are computed", name, e)
            return None
        return slots
