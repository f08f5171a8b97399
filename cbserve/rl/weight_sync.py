"""The collective transport of an RL weight sync: a trainer broadcasts HF-named tensors to every engine rank.

The trainer is rank 0 of a *stateless* group that also holds every tensor-parallel rank of every engine replica
(rank = ``WeightTransferInfo.rank_offset + tp_rank``): its own ``TCPStore`` (hosted by rank 0) and a
``ProcessGroupGloo`` / ``ProcessGroupNCCL`` backend used directly, so it never creates, reads or changes
torch.distributed's default group, which the engine ranks may already be in (their tensor-parallel group). torch
has no public way to build a group without the default one (``new_group`` needs it), hence the backend classes.

Wire protocol of one ``send``, every message a broadcast from rank 0:

1. an int64 tensor ``[n]``, then ``n`` uint8: UTF-8 JSON ``{"v": 1, "buckets": [size, ...], "tensors": [[name,
   dtype, shape, bucket, offset, nbytes], ...]}`` in bucket order (JSON, not pickle: receivers run nothing sent);
2. one uint8 tensor per bucket: the raw bytes of its tensors, each at a 64-byte aligned offset. A bucket takes
   tensors until ``bucket_bytes`` would be passed; a larger tensor is a bucket of its own (sent from its own
   memory, no copy). Empty buckets are not broadcast.

Receivers view each tensor back out of its bucket (same dtype, shape and bits) and yield it as soon as its bucket
has arrived, so an engine loads bucket by bucket and never holds a second copy of the model (see ``receive`` for
how long a tensor stays valid). ``receive`` must be iterated to the end, or the group falls out of step.
"""

from __future__ import annotations

import itertools
import json
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DEFAULT_BUCKET_BYTES = 256 << 20
PROTOCOL_VERSION = 1
_ALIGN = 64
_PREFIX = "cbserve/weight_sync"


class WeightSyncError(RuntimeError):
    """A broadcast of the weight group failed: a member left, died or did not take part in time."""


@dataclass(frozen=True)
class WeightTransferInfo:
    """What a trainer hands to the ranks of one engine replica (plain and picklable): rank = offset + tp_rank."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    rank_offset: int = 1
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _check_args(self.rank_offset, self.world_size, self.backend, self.timeout_s)
        if self.rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {self.rank_offset}")

    def rank(self, tp_rank: int) -> int:
        return self.rank_offset + tp_rank

    def open(self, tp_rank: int) -> WeightGroup:
        """Join the group as this replica's tensor-parallel rank ``tp_rank`` (blocks until everybody joined)."""
        return WeightGroup.open(self.host, self.port, self.rank(tp_rank), self.world_size, self.backend, self.timeout_s)

    @classmethod
    def for_replicas(
        cls, host: str, port: int, tp_sizes: list[int], backend: str = "gloo", timeout_s: float = 300.0
    ) -> list[WeightTransferInfo]:
        """One info per engine replica of tensor-parallel size ``tp_sizes[i]``; world = 1 + sum(tp_sizes)."""
        offsets = itertools.accumulate([1, *tp_sizes[:-1]])
        world = 1 + sum(tp_sizes)
        return [cls(host, port, world, backend, offset, timeout_s) for offset in offsets]


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(weights: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) pairs of a mapping (a ``state_dict()``) or of pairs; detached, contiguous."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        if not isinstance(name, str) or not hasattr(tensor, "detach"):
            raise TypeError(f"weights must be (HF name, torch.Tensor) pairs or a mapping of them, got {name!r}")
        out.append((name, tensor.detach().cpu().contiguous()))
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for the trainer's store (another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _first_line(e: BaseException) -> str:
    """torch's distributed errors carry a C++ backtrace after their first line."""
    return str(e).strip().split("\n", 1)[0]


def _check_args(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2 (the trainer and at least one engine rank), got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")


def _connect_store(host: str, port: int, rank: int, timeout: timedelta) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, None, rank == 0, timeout, wait_for_workers=False)
    except RuntimeError as e:
        if rank == 0:
            raise WeightSyncError(
                f"rank 0 could not host the weight group's store on {host}:{port}: {_first_line(e)}"
            ) from e
        raise TimeoutError(
            f"rank {rank} could not reach the weight group's store at {host}:{port} (hosted by the trainer, rank 0) "
            f"within {timeout.total_seconds():g} s: {_first_line(e)}"
        ) from e


def _join(store: dist.Store, rank: int, world_size: int, timeout: timedelta, where: str) -> None:
    """Every rank announces itself and waits for all others; a timeout names the ranks that did not join."""
    store.set(f"join/{rank}", "1")
    keys = [f"join/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError as e:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(
            f"weight group {where}: ranks {missing} of {world_size} did not join within "
            f"{timeout.total_seconds():g} s (seen from rank {rank})"
        ) from e


def _make_backend(backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.Backend:
    if backend == "gloo":  # honours GLOO_SOCKET_IFNAME, like the default group
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    # CUDA builds only: the communicator binds to torch.cuda.current_device() at the first broadcast, so each
    # rank selects its GPU (torch.cuda.set_device) before opening; NCCL's watchdog enforces the timeout.
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    return ProcessGroupNCCL(store, rank, world_size, options)


@dataclass(frozen=True)
class _Slot:
    """Where one tensor lies in the stream: its bucket and its byte range there."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r} in the weight sync metadata")
    return dtype


def plan_buckets(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> tuple[list[_Slot], list[int]]:
    """The slots of ``tensors`` in order and the byte size of each bucket (see the module docstring)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    slots: list[_Slot] = []
    sizes: list[int] = []
    fill = bucket_bytes  # no open bucket yet
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        offset = -(-fill // _ALIGN) * _ALIGN
        if offset + nbytes > bucket_bytes and (fill > 0 or not sizes):
            sizes.append(0)
            offset = 0
        slots.append(_Slot(name, t.dtype, tuple(t.shape), len(sizes) - 1, offset, nbytes))
        fill = sizes[-1] = offset + nbytes
    return slots, sizes


def _encode_header(slots: list[_Slot], sizes: list[int]) -> torch.Tensor:
    rows = [[s.name, str(s.dtype).removeprefix("torch."), list(s.shape), s.bucket, s.offset, s.nbytes] for s in slots]
    text = json.dumps({"v": PROTOCOL_VERSION, "buckets": sizes, "tensors": rows})
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def _decode_header(raw: bytes) -> tuple[list[_Slot], list[int]]:
    header = json.loads(raw)
    if header.get("v") != PROTOCOL_VERSION:
        raise WeightSyncError(f"weight sync protocol {header.get('v')} from the trainer, expected {PROTOCOL_VERSION}")
    slots = [_Slot(n, _parse_dtype(d), tuple(s), b, o, nb) for n, d, s, b, o, nb in header["tensors"]]
    return slots, header["buckets"]


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class WeightGroup:
    """One member of the weight group: rank 0 (the trainer) sends, every other rank receives."""

    def __init__(
        self, store: dist.Store, backend: dist.Backend, rank: int, world_size: int, kind: str, where: str
    ) -> None:
        self._store, self._pg = store, backend
        self.rank, self.world_size, self.backend, self.where = rank, world_size, kind, where

    @classmethod
    def open(
        cls, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300
    ) -> WeightGroup:
        """Join the group; rank 0 hosts its store. Blocks until all ``world_size`` ranks joined, else TimeoutError."""
        _check_args(rank, world_size, backend, timeout_s)
        timeout = timedelta(seconds=timeout_s)
        where = f"{host}:{port}"
        store = _connect_store(host, port, rank, timeout)
        prefixed = dist.PrefixStore(_PREFIX, store)
        _join(prefixed, rank, world_size, timeout, where)
        pg = _make_backend(backend, dist.PrefixStore("pg", prefixed), rank, world_size, timeout)
        return cls(store, pg, rank, world_size, backend, where)

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        if self._pg is not None:
            self._pg.shutdown()
        self._pg = self._store = None

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        if self._pg is None:
            raise WeightSyncError(f"weight group {self.where} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            self._pg.broadcast([tensor], opts).wait()
        except RuntimeError as e:
            raise WeightSyncError(
                f"weight group {self.where}, rank {self.rank} of {self.world_size}: the broadcast of {what} failed "
                f"(a member left, died or did not take part in time): {_first_line(e)}"
            ) from e

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Rank 0: broadcast the tensors (references are listed first: the metadata goes ahead). Returns bytes."""
        if self.rank != 0:
            raise ValueError(f"only rank 0 (the trainer) sends; this is rank {self.rank}")
        tensors = list(named_tensors)
        slots, sizes = plan_buckets(tensors, bucket_bytes)
        payload = _encode_header(slots, sizes)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), "the metadata size")
        self._broadcast(payload.to(self.device), "the metadata")
        stage = torch.empty(0, dtype=torch.uint8, device=self.device)  # packing buffer, reused across buckets
        pairs = zip(slots, (t for _, t in tensors), strict=True)
        for bucket, group in itertools.groupby(pairs, key=lambda pair: pair[0].bucket):
            items, size = list(group), sizes[bucket]
            if len(items) == 1:  # a bucket of one tensor (an over-size one): sent from its own memory
                data = _raw_bytes(items[0][1]).to(self.device)
            else:
                stage = stage if stage.numel() >= size else torch.empty(size, dtype=torch.uint8, device=self.device)
                data = stage[:size]
                for slot, t in items:
                    data[slot.offset : slot.offset + slot.nbytes].copy_(_raw_bytes(t))
            if size:
                self._broadcast(data, f"bucket {bucket + 1}/{len(sizes)}")
        return sum(sizes)

    def _receive_header(self) -> tuple[list[_Slot], list[int]]:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(size, "the metadata size")
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(payload, "the metadata")
        return _decode_header(payload.cpu().numpy().tobytes())

    def receive(self, reuse_buffer: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks > 0: yield (name, tensor) bucket by bucket, on ``self.device``; iterate it to the end.

        By default every bucket is a fresh buffer: a tensor stays valid (a view keeping its bucket alive).
        ``reuse_buffer=True`` receives every bucket into one buffer (no page faults of fresh memory: about twice
        the throughput on CPU), so a tensor is only valid until the iterator is advanced past its bucket:
        copy it into the model (or clone it) before asking for the next one.
        """
        if self.rank == 0:
            raise ValueError("rank 0 (the trainer) sends; it cannot receive")
        return self._receive(reuse_buffer)

    def _receive(self, reuse_buffer: bool) -> Iterator[tuple[str, torch.Tensor]]:
        slots, sizes = self._receive_header()
        shared = torch.empty(max(sizes, default=0) if reuse_buffer else 0, dtype=torch.uint8, device=self.device)
        for bucket, group in itertools.groupby(slots, key=lambda s: s.bucket):
            size = sizes[bucket]
            buf = shared[:size] if reuse_buffer else torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                self._broadcast(buf, f"bucket {bucket + 1}/{len(sizes)}")
            for s in group:
                yield s.name, buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)
