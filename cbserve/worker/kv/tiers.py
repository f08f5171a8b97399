"""The KV tiers below the pool, the worker's half (scheduler/kv/connector.py's ``WorkerConnector``; the scheduler's
half, which decides every move, is scheduler/kv/offload.py).

- The RAM tier: one tensor per block, ``[layers, 2 (K, V), block_size, kv_heads, head_dim]``, in the cache's dtype
  (lossless: a restored block gives the tokens a recomputed one gives; ``kv_offloading_dtype: bfloat16`` halves a
  float32 cache's blocks instead, rounding them; ``int8`` quarters them: each token's head vector as int8 with one
  float32 scale, its largest magnitude / 127, kept beside in ``scales``), on the CPU (pinned on CUDA).
- The disk tier: one checked file per block in this model's folder (disk.py; the folder's key names the model's
  files, dtype, block size and tensor-parallel rank, so that two models never share blocks), written by a
  background thread; a truncated or corrupt file is reported failed (the scheduler drops it, the tokens are
  computed), never served. Replicas of one node share the
  folder: a restarted replica finds what is there, and every ``RESCAN_S`` the background thread lists the folder
  and reports the files other replicas wrote since (as its own writes are reported: ``on_disk``), so that a prefix
  one replica computed is a disk hit for the others. Each replica then keeps its index within its own
  ``kv_disk_size`` (deleting the least recently used files, whoever wrote them): the folder stays within the
  smallest of the replicas' sizes.

On CUDA blocks move whole: a step's blocks are gathered on the device (every layer's K and V of a block stacked), then
copied one block at a time straight into its pinned slot, and back the same way (no staging through pageable memory);
on the CPU each layer's K and V are gathered into the slots directly.

Prefill/decode disaggregation (shared.py, ``HandOff``): a producer's RAM tier lives in a shared-memory file under
its engine id, every slot tagged with the block it holds; a consumer's ``pulls`` copy published blocks from a
producer's file (or, from another node, through the served engine's remote pull: pulls.py) into its own RAM tier in
a background thread of their own, waiting up to ``pull_wait_s`` for a block the producer has not published yet (its
store comes with its next step), then reporting it failed.

Each step's ``KVTransfer`` is carried out before its forward pass: stores (pool -> RAM, and queued for disk),
loads (RAM -> pool), evictions; prefetches (disk -> RAM) and deletions run in the background thread and are
reported in a later step's ``KVTransferResult``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbserve.scheduler.config import OffloadConfig
from cbserve.scheduler.kv.connector import KVTransfer, KVTransferResult
from cbserve.scheduler.kv.offload import disk_names, oldest_first, scan_disk
from cbserve.worker.kv.disk import BlockFiles, remove_orphans, tier_key
from cbserve.worker.kv.pulls import RemotePull, pull
from cbserve.worker.kv.shared import SUFFIX, Producers, SharedSlots, as_tag, producer_name, remove_dead

logger = logging.getLogger(__name__)

POLL_WAIT_S = 0.01  # a step sent only to collect prefetch reports waits this long for one
RESCAN_S = 5.0  # how often the disk tier's folder is listed for other replicas' files
MAX_RUNS = 4  # a step's blocks in at most this many runs of consecutive RAM slots move in one copy, not two
PULL_THREADS = 2  # pulls run side by side: one waiting on a slow producer does not hold up the others


@dataclass(frozen=True)
class HandOff:
    """This engine's part in prefill/decode disaggregation: its ``role``, the shared folder, the model's tier key
    (producers' file names start with it), how long a producer keeps a request's blocks and a consumer waits for
    them to be published, and how a consumer pulls them (pulls.py's ``transport``)."""

    role: str
    folder: Path
    key: str
    transfer_timeout_s: float
    pull_wait_s: float
    transport: str = "auto"


class KVTiers:
    def __init__(self, ram_bytes: int, disk_dir: Path | None, disk_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, pin: bool = False, handoff: HandOff | None = None) -> None:
        """``dtype``: the tiers' (the cache's; bfloat16 for a float32 cache: rounded on store, widened on load; int8:
        quantized per token and head with a float32 scale)."""
        self.block_shape = block_shape  # [layers, 2, block_size, kv_heads, head_dim]
        self.dtype = dtype
        self.scale_shape = block_shape[:-1] if dtype == torch.int8 else None  # a scale per token and head
        scale_bytes = torch.Size(self.scale_shape).numel() * 4 if self.scale_shape else 0
        self.block_bytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size() + scale_bytes
        publish = handoff is not None and handoff.role in ("kv_producer", "kv_both")
        name = producer_name(handoff.key) if publish else None  # type: ignore[union-attr]
        part = {} if handoff is None else {"role": handoff.role, "shm_name": name,
                                           "transfer_timeout_s": handoff.transfer_timeout_s}  # fmt: skip
        self.config = OffloadConfig(ram_bytes // self.block_bytes, None if disk_dir is None else str(disk_dir),
                                    disk_bytes // self.block_bytes if disk_dir is not None else 0, **part)
        self.disk_dir = disk_dir
        self.files = None if disk_dir is None else BlockFiles(disk_dir, block_shape, dtype, self.scale_shape,
                                                              self.block_bytes)
        self.known: set[int] = set()  # the disk files this replica wrote, or reported, and did not delete
        self._scanned_at = time.monotonic()
        self._scanning = False
        if disk_dir is not None:
            disk_dir.mkdir(parents=True, exist_ok=True)
            remove_orphans(disk_dir)
            self.known.update(scan_disk(str(disk_dir)))  # the scheduler's index starts from the same listing
        # The RAM tier: one tensor of ``ram_blocks`` slots, allocated once (exactly what the operator gave; pinned on
        # CUDA, the pages touched as blocks come), a block in a slot, ``ram`` its hash's slot.
        self.handoff, self.shared, self.producers = handoff, None, None
        if handoff is not None:
            handoff.folder.mkdir(parents=True, exist_ok=True)
            remove_dead(handoff.folder)
            if name is not None:  # the RAM tier is the shared file's slots
                self.shared = SharedSlots(handoff.folder / f"{name}{SUFFIX}", self.config.ram_blocks, block_shape,
                                          dtype, create=True)
            if handoff.role in ("kv_consumer", "kv_both"):
                self.producers = Producers(handoff.folder, handoff.key, block_shape, dtype)
        self.remote: RemotePull | None = None  # pulls from producers on other nodes (set by a served engine)
        self.slots = self.shared.slots if self.shared is not None else \
            torch.empty((self.config.ram_blocks, *block_shape), dtype=dtype, pin_memory=pin)
        self.whole_blocks = False  # move whole blocks (always on CUDA; tests set it to run that path on a CPU)
        self.scales = None if self.scale_shape is None else \
            torch.empty((self.config.ram_blocks, *self.scale_shape), dtype=torch.float32, pin_memory=pin)
        self.free = list(range(self.config.ram_blocks))  # a heap: the lowest free slot first, so a step's blocks
        # tend to take consecutive slots (runs that move in one copy) whatever order the earlier ones were freed in
        self.ram: dict[int, int] = {}
        self.kv_caches: list = []
        self._io = ThreadPoolExecutor(1, "cbserve-kv-disk")  # disk writes, reads and deletions, in order
        self._puller = ThreadPoolExecutor(PULL_THREADS, "cbserve-kv-pull")  # pulls from producers (disaggregation)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._report = KVTransferResult()

    # ---- WorkerConnector ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, t: KVTransfer) -> None:
        """The step's moves, in this order: evictions (the scheduler never evicts a block this step loads), stores,
        loads; the disk's work is queued for the background thread: its deletions before its writes (a block the
        scheduler evicts from disk and stores again in one step ends on disk, as its index says), prefetches last."""
        for h in t.evict:
            self._release(h)
        for h in t.disk_evict:
            self._io.submit(self._unlink, h)
        start = time.perf_counter()
        if t.stores:
            self._store(t.stores)
        stored = time.perf_counter()
        if t.loads:
            self._load(t.loads)
        with self._lock:
            r = self._report
            r.bytes_stored += len(t.stores) * self.block_bytes
            r.bytes_loaded += len(t.loads) * self.block_bytes
            r.store_s += stored - start
            r.load_s += time.perf_counter() - stored
        for h in t.prefetch:
            self._io.submit(self._read, h, self._slot(h))
        by_producer: dict[str, list[tuple[int, int]]] = {}
        for h, producer in t.pulls:
            by_producer.setdefault(producer, []).append((h, self._slot(h)))
        for producer, items in by_producer.items():
            self._puller.submit(self._pull, producer, items, time.monotonic())

    def get_finished(self) -> KVTransferResult | None:
        if self.disk_dir is not None and not self._scanning and time.monotonic() - self._scanned_at >= RESCAN_S:
            self._scanning = True  # (the background thread lists the folder, in order with its writes)
            self._io.submit(self._rescan)
        with self._lock:
            r, self._report = self._report, KVTransferResult()
        return r if (r.on_disk or r.off_disk or r.prefetched or r.failed or r.bytes_stored or r.bytes_loaded) else None

    def _rescan(self) -> None:
        """Report the files other replicas wrote into the folder since the last listing (oldest first), and those they
        deleted (this thread's own writes and deletions run in order with it: ``known`` is exact here)."""
        assert self.disk_dir is not None
        try:
            found = disk_names(str(self.disk_dir))
            with self._lock:
                fresh = {h: e for h, e in found.items() if h not in self.known}
                gone = [h for h in self.known if h not in found]
            new = oldest_first(fresh)  # only the new files are looked at
            with self._lock:
                self.known.update(new)
                self.known.difference_update(gone)
                self._report.on_disk.extend(new)
                self._report.off_disk.extend(gone)
        except OSError as e:
            logger.warning("KV disk tier: listing %s failed (%s); tried again in %.0f s", self.disk_dir, e, RESCAN_S)
        finally:
            self._scanned_at, self._scanning = time.monotonic(), False

    def wait_for_prefetch(self, timeout_s: float = POLL_WAIT_S) -> None:
        """Until a prefetch lands or fails, or ``timeout_s`` (a poll step's wait: no busy loop while one runs)."""
        with self._arrived:  # (waits even with none under way: a poll never spins)
            if not (self._report.prefetched or self._report.failed):
                self._arrived.wait(timeout_s)

    def shutdown(self) -> None:
        self._io.shutdown(wait=True)
        self._puller.shutdown(wait=True, cancel_futures=True)
        if self.shared is not None:  # a consumer that maps it keeps its pages until it lets go
            self.shared.path.unlink(missing_ok=True)

    # ---- pool <-> RAM ---------------------------------------------------------------------------------
    def _slot(self, h: int) -> int:
        with self._lock:
            slot = self.ram.get(h)
            if slot is None:
                slot = self.ram[h] = heapq.heappop(self.free)  # the scheduler keeps the tier within its slots
            return slot

    def _release(self, h: int) -> None:
        with self._lock:
            slot = self.ram.pop(h, None)
            if slot is not None:
                heapq.heappush(self.free, slot)

    def _store(self, stores: list[tuple[int, int]]) -> None:
        device = self.kv_caches[0][0].device
        ids = torch.tensor([b for b, _ in stores], dtype=torch.long, device=device)
        slot_list = [self._slot(h) for _, h in stores]
        if self.shared is not None:  # a consumer never takes a slot while it is written
            self.shared.tags[slot_list] = 0
        if self.whole_blocks or device.type == "cuda":
            self._store_whole(ids, slot_list)
        elif (runs := self._runs(slot_list)) is not None:  # a few runs of slots: each gather lands in them
            for (layer, kv), i, (j, first, n) in itertools.product(enumerate(self.kv_caches), (0, 1), runs):
                torch.index_select(kv[i], 0, ids[j:j + n], out=self.slots[first:first + n, layer, i])
        else:
            slots = torch.tensor(slot_list, dtype=torch.long)
            for layer, kv in enumerate(self.kv_caches):  # one gather per layer and K/V, into the slots
                for i in (0, 1):
                    q, scale = self._encode(kv[i].index_select(0, ids))
                    self.slots[:, layer, i].index_copy_(0, slots, q)  # (a copy per block, no index_put_)
                    if scale is not None:
                        self.scales[slots, layer, i] = scale  # type: ignore[index]
        if self.shared is not None:
            self.shared.tags[slot_list] = torch.tensor([as_tag(h) for _, h in stores], dtype=torch.int64)
        if self.disk_dir is not None:
            for (_, h), slot in zip(stores, slot_list, strict=True):  # the slot may be reused before it is written
                scale = None if self.scales is None else self.scales[slot].clone()
                self._io.submit(self._write, h, self.slots[slot].clone(), scale)

    def _store_whole(self, ids: torch.Tensor, slots: list[int]) -> None:
        """The blocks gathered on the device, every layer's K and V stacked, then one copy per block straight into its
        slot (pinned on CUDA: a DMA, no staging through pageable memory)."""
        blocks = torch.stack([torch.stack([kv[0].index_select(0, ids), kv[1].index_select(0, ids)], 1)
                              for kv in self.kv_caches], 1)  # [n, layers, 2, block_size, heads, head_dim]
        q, scale = self._encode(blocks, on_device=True)
        for j, slot in enumerate(slots):
            self.slots[slot].copy_(q[j], non_blocking=True)
            if scale is not None:
                self.scales[slot].copy_(scale[j], non_blocking=True)  # type: ignore[index]
        if q.is_cuda:
            torch.cuda.current_stream(q.device).synchronize()  # the slots are read (disk writes, loads) after this

    def _runs(self, slot_list: list[int]) -> list[tuple[int, int, int]] | None:
        """(index in ``slot_list``, first slot, length) of its runs of consecutive slots, where the blocks move
        unchanged (the cache's dtype, no int8 scales) and there are at most MAX_RUNS runs; else None."""
        starts = [j for j in range(len(slot_list)) if j == 0 or slot_list[j] != slot_list[j - 1] + 1]
        if len(starts) > MAX_RUNS or self.scales is not None or self.dtype != self.kv_caches[0][0].dtype:
            return None
        return [(j, slot_list[j], end - j) for j, end in zip(starts, [*starts[1:], len(slot_list)], strict=True)]

    def _encode(self, x: torch.Tensor, on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` in the tier's format (on the CPU unless ``on_device``): values, and the int8 tier's scales."""
        if self.scales is None:
            return (x.to(self.dtype) if on_device else x.to("cpu", self.dtype)), None
        q, scale = quantize_int8(x)
        return (q, scale) if on_device else (q.to("cpu"), scale.to("cpu"))

    def _load(self, loads: list[tuple[int, int]]) -> None:
        k0 = self.kv_caches[0][0]
        ids = torch.tensor([b for b, _ in loads], dtype=torch.long, device=k0.device)
        slot_list = [self.ram[h] for _, h in loads]
        if self.whole_blocks or k0.is_cuda:  # one copy per block from its (pinned) slot, then per layer on the device
            blocks = torch.empty((len(loads), *self.block_shape), dtype=self.dtype, device=k0.device)
            scales = None if self.scales is None else \
                torch.empty((len(loads), *self.scales.shape[1:]), dtype=torch.float32, device=k0.device)
            for j, slot in enumerate(slot_list):
                blocks[j].copy_(self.slots[slot], non_blocking=True)
                if scales is not None:
                    scales[j].copy_(self.scales[slot], non_blocking=True)  # type: ignore[index]
            for layer, kv in enumerate(self.kv_caches):
                for i in (0, 1):
                    x = blocks[:, layer, i]
                    if scales is not None:
                        x = x.float() * scales[:, layer, i].unsqueeze(-1)
                    kv[i].index_copy_(0, ids, x.to(k0.dtype))
            return
        runs = self._runs(slot_list)
        if runs is not None:  # slots in a few runs: each scatter reads them in place (one copy, not two)
            for (layer, kv), i, (j, first, n) in itertools.product(enumerate(self.kv_caches), (0, 1), runs):
                kv[i].index_copy_(0, ids[j:j + n], self.slots[first:first + n, layer, i])
            return
        slots = torch.tensor(slot_list, dtype=torch.long)
        for layer, kv in enumerate(self.kv_caches):
            for i in (0, 1):
                x = self.slots[:, layer, i].index_select(0, slots)  # (1.4x a gather by advanced indexing)
                if self.scales is not None:
                    x = x.float() * self.scales[slots, layer, i].unsqueeze(-1)
                kv[i].index_copy_(0, ids, x.to(k0.dtype))

    # ---- disk (the background thread) ---------------------------------------------------------------
    def _write(self, h: int, block: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        if self.files is not None and self.files.write(h, block, scale):
            with self._lock:
                self._report.on_disk.append(h)
                self.known.add(h)

    def _read(self, h: int, slot: int) -> None:
        assert self.files is not None
        block, nbytes = self.files.read(h), 0
        if block is None:
            self._unlink(h)  # a bad file is never read again (by this replica or another)
        with self._arrived:
            if block is not None and self.ram.get(h) == slot:  # (a slot released meanwhile is another's now)
                self._fill(slot, h, block[0], block[1])  # reserved: the scheduler offers it once the report is in
            if block is None:
                self._report.failed.append(h)  # its slot is released by the scheduler's eviction of the entry
            else:
                self._report.prefetched.append(h)
                nbytes = self.block_bytes
            self._report.bytes_from_disk += nbytes
            self._arrived.notify_all()

    def _fill(self, slot: int, h: int, block: torch.Tensor, scale: torch.Tensor | None) -> None:
        """A slot's block from elsewhere (disk, a producer), its tag cleared while it is written."""
        if self.shared is not None:
            self.shared.tags[slot] = 0
        self.slots[slot].copy_(block)
        if self.scales is not None and scale is not None:
            self.scales[slot].copy_(scale)
        if self.shared is not None:
            self.shared.tags[slot] = as_tag(h)

    def _unlink(self, h: int) -> None:
        if self.files is not None:
            self.files.path(h).unlink(missing_ok=True)
        with self._lock:
            self.known.discard(h)

    # ---- pulls from producers (their thread) --------------------------------------------------------
    def _pull(self, producer: str, items: list[tuple[int, int]], asked_at: float) -> None:
        """Copy the producer's published blocks into their slots here (pulls.py); one not there within
        ``pull_wait_s`` of ``asked_at`` fails."""
        try:
            done, remote = pull(self, producer, items, asked_at)
        except Exception:  # a pull that broke is a failed pull: the blocks are computed
            logger.exception("KV pull from %s failed; its blocks are computed", producer)
            done, remote = [], False
        landed = set(done)
        failed = [h for h, _ in items if h not in landed]
        with self._arrived:
            r = self._report
            r.prefetched.extend(done)
            r.pulled.extend(done)
            r.failed.extend(failed)
            r.bytes_pulled += len(done) * self.block_bytes
            r.bytes_pulled_ray += len(done) * self.block_bytes if remote else 0
            r.pull_s += time.monotonic() - asked_at
            self._arrived.notify_all()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., head_dim] as int8 values and a float32 scale per vector (its largest magnitude / 127; 1 for a
    vector of zeros): x ~= q * scale."""
    scale = x.float().abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def build_kv_tiers(runner: Any) -> KVTiers | None:
    """The tiers of a ModelRunner whose config asks for them (``kv_offloading_bytes``), else None."""
    config = runner.config
    if not config.kv_offloading_bytes:
        return None
    files = [*runner.model_folder.glob("*.safetensors"), runner.model_folder / "config.json"]
    key = tier_key([f for f in files if f.exists()], runner.dtype, runner.block_size, config.rank,
                   config.tensor_parallel_size, config.kv_offloading_dtype)
    disk_dir = None if config.kv_disk_path is None else Path(config.kv_disk_path) / key
    handoff = None if config.kv_role is None else HandOff(config.kv_role, Path(config.kv_shm_path), key,
                                                          config.kv_transfer_timeout_s, config.kv_pull_wait_s,
                                                          config.kv_transport)
    shape = (runner.num_layers, 2, runner.block_size, runner.num_kv_heads, runner.head_dim)
    dtype = {"bfloat16": torch.bfloat16, "int8": torch.int8}.get(config.kv_offloading_dtype, runner.dtype)
    tiers = KVTiers(config.kv_offloading_bytes, disk_dir, config.kv_disk_bytes, shape, dtype,
                    pin=runner.device.type == "cuda", handoff=handoff)
    logger.info("KV tiers: RAM %d blocks (%.1f MiB)%s%s", tiers.config.ram_blocks,
                tiers.config.ram_blocks * tiers.block_bytes / 2**20,
                "" if disk_dir is None else f", disk {tiers.config.disk_blocks} blocks in {disk_dir}",
                "" if handoff is None else f"; {handoff.role} in {handoff.folder}"
                + ("" if tiers.config.shm_name is None else f" as {tiers.config.shm_name}"))
    return tiers
