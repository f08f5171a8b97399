"""The KV hand-off of prefill/decode disaggregation, measured against this machine's copy bandwidth: a 2k-token
prompt's KV blocks of a real model shape (default: SmolLM2-135M's, 30 layers x 3 KV heads x 64, float32 and
bfloat16) go from a producer's pool to a consumer's pool in separate processes of one node, as they do served:

1. store: the producer's pool -> its shared-memory RAM tier (worker/kv/tiers.py ``_store``, tags included);
2. pull: the producer's shared tier -> the consumer's RAM tier (``_pull``, in the consumer's process);
3. load: the consumer's RAM tier -> its pool (``_load``).

Each figure is a median over --repeats and is set beside the copy bandwidth measured in the same run
(``torch.Tensor.copy_`` of the same bytes between two pre-touched buffers, one thread as the tiers use, and the
machine's threads) and beside the Ray object store, the transport across nodes, as served engines run it (a consumer
actor whose folder lacks the producer's file pulls through the producer's ``KVSource`` actor, which reads the file;
on one node the object store's copy is zero-copy, across nodes Ray's transfer adds the network's time).
Writes ``pd_transfer.json`` to --out-dir.

    .venv/bin/python benchmarks/bench_pd_transfer.py                 # ~1 min
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_info import cpu_model  # noqa: E402

from cbserve.scheduler.kv.connector import KVTransfer  # noqa: E402
from cbserve.worker.kv.tiers import HandOff, KVTiers  # noqa: E402

BLOCK = 16


def _tiers(role: str, folder: Path, shape: tuple[int, ...], dtype: torch.dtype, blocks: int,
           transport: str = "auto") -> KVTiers:
    ram = (blocks + 8) * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return KVTiers(ram, None, 0, shape, dtype, handoff=HandOff(role, folder, "bench", 30.0, 5.0, transport))


def _pool(shape: tuple[int, ...], dtype: torch.dtype, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers, _, bs, heads, dim = shape
    return [(torch.randn(blocks + 4, bs, heads, dim).to(dtype), torch.randn(blocks + 4, bs, heads, dim).to(dtype))
            for _ in range(layers)]


def _pull_and_load(tiers: KVTiers, producer: str, hashes: list[int]) -> dict[str, Any]:
    """A consumer's pull of ``hashes`` from ``producer`` and their load into its pool, timed; then evicted."""
    t0 = time.perf_counter()
    tiers.start_load_kv(KVTransfer(pulls=[(h, producer) for h in hashes]))
    report = None
    while report is None or not (report.prefetched or report.failed):
        tiers.wait_for_prefetch(0.05)
        report = tiers.get_finished() or report
    pulled = time.perf_counter()
    ok = len(report.pulled) == len(hashes)
    tiers.start_load_kv(KVTransfer(loads=[(i, h) for i, h in enumerate(hashes)]))
    row = {"pull_s": pulled - t0, "load_s": time.perf_counter() - pulled, "ok": ok}
    tiers.start_load_kv(KVTransfer(evict=list(hashes)))
    return row


def consumer(conn: Any, folder: str, shape: tuple[int, ...], dtype_name: str, blocks: int) -> None:
    """The consumer's process: pulls and loads what the producer names, reports seconds."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    tiers = _tiers("kv_consumer", Path(folder), shape, dtype, blocks)
    tiers.register_kv_caches(_pool(shape, dtype, blocks))
    while (msg := conn.recv()) is not None:
        conn.send(_pull_and_load(tiers, *msg))
    tiers.shutdown()


class RayConsumer:
    """The Ray object store as the transport, as served engines use it across nodes: a consumer actor whose folder
    does not hold the producer's file pulls through the producer's ``KVSource`` (cluster/engine/kv_source.py)."""

    def __init__(self, folder: str, shape: tuple[int, ...], dtype_name: str, blocks: int) -> None:
        from cbserve.cluster.engine.kv_source import attach_ray_transport

        torch.set_num_threads(1)
        dtype = getattr(torch, dtype_name)
        self.tiers = _tiers("kv_consumer", Path(folder), shape, dtype, blocks, transport="ray")
        self.tiers.register_kv_caches(_pool(shape, dtype, blocks))
        attach_ray_transport(self.tiers)

    def take(self, producer: str, hashes: list[int]) -> dict[str, Any]:
        return _pull_and_load(self.tiers, producer, hashes)


def copy_bandwidth(nbytes: int, repeats: int, threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(1)
    return nbytes / statistics.median(times) / 1e9


def measure(dtype: torch.dtype, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    shape = (args.layers, 2, BLOCK, args.kv_heads, args.head_dim)
    blocks = args.tokens // BLOCK
    producer = _tiers("kv_producer", folder, shape, dtype, blocks)
    producer.register_kv_caches(_pool(shape, dtype, blocks))
    nbytes = blocks * producer.block_bytes
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, str(folder), shape, str(dtype).split(".")[1], blocks))
    proc.start()
    rows = []
    for r in range(args.repeats):
        hashes = [(r << 32) + i + 1 for i in range(blocks)]
        t0 = time.perf_counter()
        producer.start_load_kv(KVTransfer(stores=list(enumerate(hashes))))
        store = time.perf_counter() - t0
        parent.send((producer.config.shm_name, hashes))
        rows.append({"store_s": store, **parent.recv()})
        producer.start_load_kv(KVTransfer(evict=hashes))
    ray_rows = _ray_rows(producer, shape, dtype, blocks, args.repeats, folder) if args.ray else []
    parent.send(None)
    proc.join()
    producer.shutdown()
    med = {k: statistics.median(row[k] for row in rows) for k in ("store_s", "pull_s", "load_s")}
    total = sum(med.values())
    out = {"dtype": str(dtype), "blocks": blocks, "bytes": nbytes, "all_pulled": all(r["ok"] for r in rows),
           **{k: round(v * 1e3, 3) for k, v in med.items()},
           "store_gb_s": nbytes / med["store_s"] / 1e9, "pull_gb_s": nbytes / med["pull_s"] / 1e9,
           "load_gb_s": nbytes / med["load_s"] / 1e9, "pool_to_pool_gb_s": nbytes / total / 1e9}  # fmt: skip
    if ray_rows:
        ray_med = {k: statistics.median(row[k] for row in ray_rows) for k in ("store_s", "pull_s", "load_s")}
        out["all_pulled_ray"] = all(r["ok"] for r in ray_rows)
        out["ray_pull_s"] = round(ray_med["pull_s"] * 1e3, 3)
        out["ray_pull_gb_s"] = nbytes / ray_med["pull_s"] / 1e9
        out["ray_pool_to_pool_gb_s"] = nbytes / sum(ray_med.values()) / 1e9
    return out


def _ray_rows(producer: KVTiers, shape: tuple[int, ...], dtype: torch.dtype, blocks: int, repeats: int,
              folder: Path) -> list[dict[str, float]]:
    import ray

    from cbserve.cluster.engine.kv_source import start_kv_source

    source = start_kv_source(producer)
    actor = ray.remote(num_cpus=0)(RayConsumer).remote(str(folder / "other-node"), shape, str(dtype).split(".")[1],
                                                       blocks)  # fmt: skip
    rows = []
    for r in range(repeats + 1):
        hashes = [(1 << 40) + (r << 32) + i + 1 for i in range(blocks)]
        t0 = time.perf_counter()
        producer.start_load_kv(KVTransfer(stores=list(enumerate(hashes))))
        store = time.perf_counter() - t0
        rows.append({"store_s": store, **ray.get(actor.take.remote(producer.config.shm_name, hashes))})
        producer.start_load_kv(KVTransfer(evict=hashes))
    ray.kill(actor)
    ray.kill(source)
    return rows[1:]  # the first warms the actors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-ray", dest="ray", action="store_false", help="skip the Ray object store comparison")
    p.add_argument("--out-dir", default="benchmarks/results/pd")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    doc: dict[str, Any] = {"cpu": cpu_model(), "tokens": args.tokens,
                           "shape": [args.layers, 2, BLOCK, args.kv_heads, args.head_dim], "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cbserve-pd-", dir="/dev/shm") as folder:
        for dtype in (torch.float32, torch.bfloat16):
            row = measure(dtype, args, Path(folder))
            row["copy_gb_s_1_thread"] = copy_bandwidth(row["bytes"], args.repeats, 1)
            row["copy_gb_s_all_threads"] = copy_bandwidth(row["bytes"], args.repeats, torch.get_num_interop_threads())
            doc["rows"].append(row)
            copy = row["copy_gb_s_1_thread"]
            print(f"{row['dtype']:15s} {row['bytes'] / 2**20:6.1f} MiB ({row['blocks']} blocks): store "
                  f"{row['store_gb_s']:5.1f} GB/s, pull {row['pull_gb_s']:5.1f}, load {row['load_gb_s']:5.1f}; "
                  f"pool->pool {row['pool_to_pool_gb_s']:5.1f} GB/s = {row['pool_to_pool_gb_s'] / copy:.2f}x copy "
                  f"({copy:.1f} GB/s, 1 thread); pull alone {row['pull_gb_s'] / copy:.2f}x"
                  + (f"; Ray object store: pull {row['ray_pull_gb_s']:5.1f} GB/s, pool->pool "
                     f"{row['ray_pool_to_pool_gb_s']:5.1f} GB/s" if args.ray else ""),
                  flush=True)  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pd_transfer.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / 'pd_transfer.json'} ({doc['cpu']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
