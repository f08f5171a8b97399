"""The disk tier's files: one per block in this model's folder (``<kv_disk_path>/<model key>/<hash>.kv``), written
atomically (a temporary file, then a rename) with a header holding the block's hash and a blake2b digest of the
payload, checked on every read: a truncated or corrupt file is never served (tiers.py reports it failed and the
tokens are computed)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from cbserve.scheduler.kv.offload import DISK_SUFFIX

logger = logging.getLogger(__name__)

MAGIC = b"CBKV\x01"
_HEADER = struct.Struct("<5sQ16sQ")  # magic, block hash, payload digest, payload bytes


def tier_key(model_files: list[Path], dtype: torch.dtype, block_size: int, rank: int, world: int,
             tier_dtype: str = "auto") -> str:
    """The disk tier's folder name for one model: its files (names, sizes, times), the cache's dtype and layout, the
    tiers' dtype."""
    h = hashlib.blake2b(digest_size=10)
    for f in sorted(model_files):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps([str(dtype), block_size, rank, world, tier_dtype]).encode())
    return h.hexdigest()


class BlockFiles:
    """The files of one folder, for blocks of ``block_shape`` in ``dtype`` (plus, int8, float32 scales of
    ``scale_shape``): ``block_bytes`` in all."""

    def __init__(self, folder: Path, block_shape: tuple[int, ...], dtype: torch.dtype,
                 scale_shape: tuple[int, ...] | None, block_bytes: int) -> None:
        self.folder, self.block_shape, self.dtype = folder, block_shape, dtype
        self.scale_shape, self.block_bytes = scale_shape, block_bytes

    def path(self, h: int) -> Path:
        return self.folder / f"{h:016x}{DISK_SUFFIX}"

    def write(self, h: int, block: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
        """Whether block ``h`` is on disk now (a failed write is logged and leaves nothing behind)."""
        path = self.path(h)
        payload = block.contiguous().view(torch.uint8).numpy().tobytes()
        if scale is not None:
            payload += scale.contiguous().view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(MAGIC, h, hashlib.blake2b(payload, digest_size=16).digest(), len(payload))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("KV disk tier: writing %s failed: %s", path.name, e)
            tmp.unlink(missing_ok=True)
            return False
        return True

    def read(self, h: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Block ``h`` and its scales, or None (missing, truncated or corrupt: logged)."""
        path = self.path(h)
        try:
            data = path.read_bytes()
        except OSError as e:
            logger.warning("KV disk tier: block %016x unreadable (%s); it is computed", h, e)
            return None
        if len(data) != _HEADER.size + self.block_bytes:
            logger.warning("KV disk tier: %s has %d bytes, not %d; it is computed", path.name, len(data),
                           _HEADER.size + self.block_bytes)
            return None
        magic, stored_hash, digest, size = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != MAGIC or stored_hash != h or size != self.block_bytes or \
                hashlib.blake2b(payload, digest_size=16).digest() != digest:  # fmt: skip
            logger.warning("KV disk tier: %s fails its checks (corrupt); it is computed", path.name)
            return None
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        cut = self.block_bytes - (0 if self.scale_shape is None else torch.Size(self.scale_shape).numel() * 4)
        block = raw[:cut].view(self.dtype).view(self.block_shape)
        scale = None if self.scale_shape is None else raw[cut:].view(torch.float32).view(self.scale_shape)
        return block, scale


def remove_orphans(disk_dir: Path) -> int:
    """Delete the temporary files of writes whose process is gone (killed mid-write: its block never became a file);
    a live process's are left to finish. How many went."""
    return remove_if_gone(disk_dir.glob(f".*{DISK_SUFFIX}.*.tmp"), lambda path: path.name.rsplit(".", 2)[-2])


def remove_if_gone(paths: Iterable[Path], pid_of: Callable[[Path], str]) -> int:
    """Delete the files of ``paths`` whose writer's process (the pid ``pid_of`` reads in its name) is gone, or whose
    name holds no pid; a live process's (another user's too) are kept. How many went."""
    removed = 0
    for path in paths:
        try:
            os.kill(int(pid_of(path)), 0)  # alive: a replica sharing the folder still owns it
        except (ValueError, IndexError, ProcessLookupError):
            path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:  # alive, another user's
            continue
    return removed
