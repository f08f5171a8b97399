"""Embeddings per second on CPU: a burst of short texts through cbserve (``LLM(runner="pooling").embed``, the
engine behind ``/v1/embeddings``) against sentence-transformers' ``encode`` on the same model folder, with the
vectors checked equal (cosine). The model: the bundled SmolLM2-135M as an HF folder (what
benchmarks/peers/setup_peers.sh converts for vLLM) with a sentence-transformers pipeline of last-token pooling
and normalization written beside it (a decoder embedding model's usual recipe, as gte-Qwen2 and
Qwen3-Embedding), so both sides read the same weights and pooling.

    .venv/bin/python benchmarks/bench_embeddings.py --texts 512 --out-dir benchmarks/results/embeddings

``--servers cbserve vllm`` also times ``POST /v1/embeddings`` over HTTP: ``cbserve serve --runner pooling`` and
``vllm serve --runner pooling`` (vLLM's CPU build, its own venv: benchmarks/peers/setup_peers.sh; float32, its best
dtype on a CPU without native bfloat16) on the same folder, the texts in requests of ``--request-texts`` sent by
``--concurrency`` clients, the vectors checked against sentence-transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import default_peers_dir  # noqa: E402
from cpu_info import describe  # noqa: E402

from cbserve.bench.datasets import WORDS  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402

ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def embedding_folder(hf_folder: Path, dst: Path) -> Path:
    """A copy of ``hf_folder`` with a sentence-transformers pipeline: last-token pooling, then normalize."""
    shutil.copytree(hf_folder, dst)
    (dst / "modules.json").write_text(json.dumps(ST_MODULES))
    hidden = json.loads((dst / "config.json").read_text())["hidden_size"]
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False,
        "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False, "include_prompt": True}))
    (dst / "2_Normalize").mkdir()
    (dst / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return dst


def texts(n: int, seed: int = 0) -> list[str]:
    """Short texts (8-48 words), as a RAG pipeline embeds chunks and queries."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 48))) for _ in range(n)]


def run_cbserve(folder: Path, batch: list[str]) -> tuple[float, list[list[float]]]:
    from cbserve import LLM

    llm = LLM(model=str(folder), runner="pooling", progress=False)
    llm.embed(batch[:16], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.embed(batch, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    llm.shutdown()
    return elapsed, [o.outputs.embedding for o in outs]


def run_sentence_transformers(folder: Path, batch: list[str], batch_size: int) -> tuple[float, list[list[float]]]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"torch_dtype": torch.float32})
    model.encode(batch[:16], batch_size=batch_size)  # warm-up
    t0 = time.perf_counter()
    vectors = model.encode(batch, batch_size=batch_size, convert_to_numpy=True)
    return time.perf_counter() - t0, vectors.tolist()


def post_embeddings(base_url: str, model: str, texts_: list[str]) -> list[list[float]]:
    body = json.dumps({"model": model, "input": texts_, "encoding_format": "float"}).encode()
    req = urllib.request.Request(base_url + "/v1/embeddings", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        data = json.loads(r.read())["data"]
    return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]


def time_server(base_url: str, model: str, batch: list[str], args: argparse.Namespace) -> tuple[float, list]:
    """Seconds to embed ``batch`` in requests of ``--request-texts`` texts from ``--concurrency`` clients."""
    post_embeddings(base_url, model, batch[:16])  # warm-up
    chunks = [batch[i:i + args.request_texts] for i in range(0, len(batch), args.request_texts)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        parts = list(pool.map(lambda c: post_embeddings(base_url, model, c), chunks))
    return time.perf_counter() - t0, [v for part in parts for v in part]


def run_server(name: str, folder: Path, batch: list[str], args: argparse.Namespace) -> tuple[float, list] | None:
    from cbserve.bench.deploy import HOST, free_port, local_deployment, server_process

    log = Path(args.out_dir) / f"{name}_server.log"
    if name == "cbserve":
        app = {"model": str(folder), "runner": "pooling", "served_model_name": "emb", "dtype": "float32"}
        with local_deployment(app, log_path=log) as base_url:
            return time_server(base_url, "emb", batch, args)
    exe = Path(args.vllm_venv) / "bin" / "vllm"
    if not exe.exists():
        print(f"vLLM not installed at {exe}: skipped (benchmarks/peers/setup_peers.sh)")
        return None
    port = free_port()
    cmd = [str(exe), "serve", str(folder), "--runner", "pooling", "--dtype", "float32", "--served-model-name",
           "emb", "--host", HOST, "--port", str(port), "--gpu-memory-utilization", "0.15"]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS")}
    env.update(PATH=f"{exe.parent}:{env.get('PATH', '')}", VLLM_TARGET_DEVICE="cpu")
    with server_process(cmd, f"http://{HOST}:{port}", 600, log, env):
        return time_server(f"http://{HOST}:{port}", "emb", batch, args)


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    x, y = torch.tensor(a), torch.tensor(b)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=-1).min())


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["embeddings_per_s"])
    values = [result["embeddings_per_s"][n] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.barh(names, values, color=["#2b6cb0", "#a0aec0", "#2c7a7b", "#dd6b20"][: len(names)])
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.0f}", va="center")
    ax.set_xlabel("embeddings / s (higher is better)")
    ax.set_title(f"{result['texts']} short texts, {result['model']}\n{result['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    p.add_argument("--hf-model", default=str(default_peers_dir() / "smollm2-hf"),
                   help="an HF folder of the bundled model (benchmarks/peers/setup_peers.sh hf)")
    p.add_argument("--out-dir", default="benchmarks/results/embeddings")
    p.add_argument("--servers", nargs="*", choices=["cbserve", "vllm"], default=[],
                   help="also time POST /v1/embeddings on these servers")
    p.add_argument("--request-texts", type=int, default=32, help="texts per /v1/embeddings request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--vllm-venv", default=str(default_peers_dir() / "vllm-venv"))
    args = p.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    batch = texts(args.texts)
    with tempfile.TemporaryDirectory(prefix="cbserve-emb-") as tmp:
        folder = embedding_folder(Path(args.hf_model), Path(tmp) / "smollm2-embedding")
        cb_s, cb_vecs = run_cbserve(folder, batch)
        st_s, st_vecs = run_sentence_transformers(folder, batch, args.st_batch_size)
        served = {name: run_server(name, folder, batch, args) for name in args.servers}
    result: dict[str, Any] = {
        "texts": len(batch), "model": "SmolLM2-135M (last token, normalized), float32",
        "cpu": describe(native.supported_levels()[0]),
        "embeddings_per_s": {"cbserve (offline LLM)": len(batch) / cb_s, "sentence-transformers": len(batch) / st_s},
        "seconds": {"cbserve (offline LLM)": cb_s, "sentence-transformers": st_s},
        "min_cosine_cbserve_vs_st": min_cosine(cb_vecs, st_vecs),
    }
    result["cbserve_over_st"] = st_s / cb_s
    for name, timing in served.items():
        if timing is not None:
            label = f"{name} serve (HTTP)"
            result["embeddings_per_s"][label] = len(batch) / timing[0]
            result["seconds"][label] = timing[0]
            result[f"min_cosine_{name}_serve_vs_st"] = min_cosine(timing[1], st_vecs)
    if served.get("cbserve") and served.get("vllm"):
        result["cbserve_serve_over_vllm_serve"] = served["vllm"][0] / served["cbserve"][0]
        result["http"] = {"request_texts": args.request_texts, "concurrency": args.concurrency}
    out = Path(args.out_dir)
    (out / "embeddings.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "embeddings.png")
    print(json.dumps(result, indent=2))
    print(f"cbserve / sentence-transformers: {result['cbserve_over_st']:.2f}x (goal >= 2x); "
          f"vectors agree to cosine >= {result['min_cosine_cbserve_vs_st']:.6f}")
    if "cbserve_serve_over_vllm_serve" in result:
        print(f"cbserve serve / vllm serve: {result['cbserve_serve_over_vllm_serve']:.2f}x (goal >= 1.25x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
