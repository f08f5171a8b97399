"""RL rollout controls on this CPU: weight sync, sleep and a rollout loop, over the bundled SmolLM2-135M.

1. Weight sync, served (one replica, TP=1, local Ray + Serve): the full float32 state dict, scaled slightly each
   time so every update really changes the weights, through the Ray object store (``RolloutEngines.update_weights``)
   and through a gloo weight group (``init_weight_transfer`` + ``update_weights_from_group``), for cpu_ops "auto"
   (C kernels: weights re-packed on update) and "torch", one app each, side by side. Seconds are the median of
   --reps; GB/s is the float32 state dict's bytes over the replica's sync_s (transfer + apply).
2. Sync time against model size: offline ``LLM.update_weights`` of the bundled model and of random Llama models
   (HF folders with safetensors and SmolLM2's tokenizer, written to a temp folder), up to ~0.9B parameters.
3. Sleep level 1 (offline, a 512 MiB KV cache): RSS freed against the KV cache's bytes; wake_up time and the time
   to the first token after waking.
4. Rollout throughput (offline): N steps of 16 prompts x 32 sampled tokens (temperature 1), with a weight update
   between steps against the same loop with fixed weights.

Writes ``results.json`` and ``rl.png`` to --out-dir.

    .venv/bin/python benchmarks/bench_rl.py             # the full run, ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_rl.py --quick     # smoke run: small models, fewer reps
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
from cpu_info import describe  # noqa: E402

from cbserve import LLM, SamplingParams  # noqa: E402
from cbserve.worker.cpu import native  # noqa: E402
from cbserve.worker.loading.model_loader import iter_weights, resolve_model  # noqa: E402

GB = 1e9
MIB = 2**20
GOAL_OBJECT_STORE_S = 0.5
BASE = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "max_num_seqs": 16,
        "kv_cache_memory_bytes": 64 * MIB, "enable_sleep_mode": True}  # offline LLM fields
SERVED = {"num_replicas": 1, "worker_num_cpus": 1, "node_tuning": "off"}  # the served-only fields
PROMPTS = ["Write a short story about a robot.", "Explain photosynthesis.", "List three prime numbers.",
           "What is the capital of France?", "Describe the sea at night.", "Give me a recipe for soup.",
           "Why is the sky blue?", "Name a famous painter."]  # fmt: skip


def bar(i: int, n: int, what: str) -> None:
    done = int(30 * i / max(n, 1))
    print(f"\r  [{'#' * done}{'.' * (30 - done)}] {i}/{n} {what:40s}", end="" if i < n else "\n", flush=True)


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    return {name: t.to(torch.float32).contiguous() for name, t in iter_weights(folder, progress=False)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def perturb(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Scale every tensor by 1 +- 1e-3 (alternating, so the weights stay near the trained ones): a real change."""
    factor = 1.0 + (1e-3 if step % 2 == 0 else -1e-3)
    for t in state.values():
        t.mul_(factor)
    return state


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows if key in r)


def summarize(rows: list[dict[str, Any]], total: int) -> dict[str, Any]:
    keys = sorted({k for r in rows for k, v in r.items() if k.endswith("_s") and isinstance(v, (int, float))})
    out: dict[str, Any] = {f"{k}_median": med(rows, k) for k in keys}
    sync = out.get("sync_s_median", out.get("total_s_median"))
    out.update(num_bytes=total, sync_s=sync, gb_per_s=total / GB / sync, runs=rows)
    return out


# ---- 1. served weight sync -----------------------------------------------------------------------------------------
def served_one(app: str, state: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    """Object store then gloo group, ``reps`` timed updates each after one warm-up, on one app's replica."""
    from cbserve.rl.engines import RolloutEngines

    engines = RolloutEngines(app)
    total, out = nbytes(state), {}
    for way in ("object_store", "gloo"):
        if way == "gloo":
            engines.init_weight_transfer("gloo")
        rows = []
        for i in range(reps + 1):
            bar(i, reps + 1, f"{app} {way}")
            perturb(state, i)
            t0 = time.perf_counter()
            update = engines.update_weights_from_group if way == "gloo" else engines.update_weights
            rep = update(state)[0]
            rep = {k: v for k, v in rep.items() if isinstance(v, (int, float, str))}
            rep["driver_wall_s"] = time.perf_counter() - t0
            if i:  # the first is a warm-up
                rows.append(rep)
        bar(reps + 1, reps + 1, f"{app} {way}")
        out[way] = summarize(rows, total)
    engines.close()
    return out


def served_sync(args: argparse.Namespace) -> dict[str, Any]:
    from e2e_lib import local_serve_apps

    state = load_state(resolve_model(None).folder)
    apps = {f"ops-{ops}": dict(BASE, **SERVED, cpu_ops=ops) for ops in args.cpu_ops}
    t0 = time.perf_counter()
    with local_serve_apps(apps):
        print(f"  {len(apps)} app(s) up in {time.perf_counter() - t0:.0f} s", flush=True)
        return {app.removeprefix("ops-"): served_one(app, state, args.reps) for app in apps}


# ---- 2. sync time against model size (offline) ---------------------------------------------------------------------
SIZES = {"0.25B": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16),
         "0.9B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32),
         "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4)}


def make_random_llama(dst: Path, shape: dict[str, int]) -> Path:
    """A random LlamaForCausalLM (untied head, 8 KV heads) as an HF folder with SmolLM2's tokenizer; the tensors are
    drawn directly (no nn.Module init: seconds even for ~1B)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    src = resolve_model(None).folder
    ref = json.loads((src / "config.json").read_text())
    h, inter, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], min(8, shape["num_attention_heads"])
    hd = h // heads
    cfg = LlamaConfig(vocab_size=ref["vocab_size"], num_key_value_heads=kv_heads, head_dim=hd,
                      max_position_embeddings=2048, bos_token_id=ref["bos_token_id"], eos_token_id=ref["eos_token_id"],
                      tie_word_embeddings=False, torch_dtype="float32", **shape)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (ref["vocab_size"], h), "lm_head.weight": (ref["vocab_size"], h),
              "model.norm.weight": (h,)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv_heads * hd, h),
                   p + "self_attn.v_proj.weight": (kv_heads * hd, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}  # fmt: skip
    state = {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return dst


def offline_sync(model: Path | None, reps: int, cpu_ops: str) -> dict[str, Any]:
    state = load_state(resolve_model(model).folder)
    params = sum(t.numel() for t in state.values())
    t0 = time.perf_counter()
    llm = LLM(str(model) if model else None, progress=False, **dict(BASE, cpu_ops=cpu_ops, max_num_seqs=4))
    load_s = time.perf_counter() - t0
    rows = []
    for i in range(reps + 1):
        perturb(state, i)
        t0 = time.perf_counter()
        rep = llm.update_weights(state)
        rep = {k: v for k, v in rep.items() if isinstance(v, (int, float))}
        rep["wall_s"] = time.perf_counter() - t0
        if i:
            rows.append(rep)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    llm.shutdown()
    res = summarize(rows, nbytes(state))
    res.update(params=params, engine_load_s=load_s, sample_after_update=out[0].outputs[0].text)
    return res


def size_curve(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="cbserve-bench-rl-"))
    names = ["SmolLM2-135M", *args.sizes]
    try:
        for i, name in enumerate(names):
            bar(i, len(names), f"size {name}")
            model = None if i == 0 else make_random_llama(tmp / name, SIZES[name])
            for ops in args.cpu_ops:
                try:
                    out[f"{name}/{ops}"] = offline_sync(model, args.reps, ops)
                except Exception as e:  # a new feature: report it, keep the other numbers
                    out[f"{name}/{ops}"] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"\n  {name}/{ops} FAILED: {type(e).__name__}: {e}", flush=True)
            if model is not None:
                shutil.rmtree(model, ignore_errors=True)
        bar(len(names), len(names), "sizes")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---- 3. sleep ------------------------------------------------------------------------------------------------------
def first_token_s(llm: LLM) -> float:
    t0 = time.perf_counter()
    llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - t0


def sleep_bench(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(None, progress=False, **dict(BASE, kv_cache_memory_bytes=args.sleep_kv_mib * MIB))
    sp = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True, seed=0)
    llm.generate(PROMPTS * 2, sp, use_tqdm=False)  # the KV cache in use
    ttft_before = first_token_s(llm)
    t0 = time.perf_counter()
    slept = llm.sleep(1)
    sleep_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    woke = llm.wake_up()
    wake_s = time.perf_counter() - t0
    ttft_after = first_token_s(llm)
    ttft_after_2 = first_token_s(llm)  # the one-time cost of waking gone
    llm.shutdown()
    slept = {k: v for k, v in slept.items() if isinstance(v, (int, float, str))}
    kv = slept.get("kv_cache_bytes") or args.sleep_kv_mib * MIB
    return {"sleep": slept, "wake": {k: v for k, v in woke.items() if isinstance(v, (int, float, str, list))},
            "sleep_s": sleep_s, "wake_up_s": wake_s, "first_token_before_s": ttft_before,
            "first_token_after_wake_s": ttft_after, "first_token_after_wake_2nd_s": ttft_after_2,
            "rss_freed_over_kv": slept.get("rss_freed", 0) / kv}


# ---- 4. rollout loop -----------------------------------------------------------------------------------------------
def rollout_loop(llm: LLM, state: dict[str, torch.Tensor] | None, args: argparse.Namespace) -> dict[str, Any]:
    sp = SamplingParams(max_tokens=args.tokens, temperature=1.0, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.prompts)]
    gen_s, tokens, updates = 0.0, 0, []
    versions = set()
    for step in range(args.steps):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        gen_s += time.perf_counter() - t0
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        versions |= {o.outputs[0].weights_version for o in outs}
        if state is not None and step < args.steps - 1:
            t0 = time.perf_counter()
            llm.update_weights(perturb(state, step))
            updates.append(time.perf_counter() - t0)
    upd_s = sum(updates)
    wall = gen_s + upd_s
    return {"steps": args.steps, "tokens": tokens, "gen_s": gen_s, "update_s": upd_s, "wall_s": wall,
            "tok_s": tokens / wall, "gen_only_tok_s": tokens / gen_s, "weights_versions_seen": sorted(versions),
            "update_each_s": updates}


def rollout_bench(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(None, progress=False, **dict(BASE, max_num_seqs=args.prompts))
    llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    state = load_state(resolve_model(None).folder)
    fixed = rollout_loop(llm, None, args)
    print(f"  fixed weights:   {fixed['tok_s']:7.1f} tok/s", flush=True)
    updated = rollout_loop(llm, state, args)
    each = ", ".join(f"{u:.2f}" for u in updated["update_each_s"])
    print(f"  updated weights: {updated['tok_s']:7.1f} tok/s (updates {each} s)", flush=True)
    llm.shutdown()
    return {"fixed": fixed, "updated": updated, "ratio_updated_over_fixed": updated["tok_s"] / fixed["tok_s"]}


# ---- report --------------------------------------------------------------------------------------------------------
def section(name: str, fn: Any, args: argparse.Namespace, doc: dict[str, Any]) -> None:
    """Run one part; a failure (new code) is recorded with its traceback and the other parts still run."""
    import traceback

    print(f"\n== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        doc[name] = fn(args)
    except Exception:
        doc[name] = {"error": traceback.format_exc()}
        print(doc[name]["error"], flush=True)
    doc.setdefault("section_wall_s", {})[name] = time.perf_counter() - t0


def print_tables(doc: dict[str, Any]) -> None:
    print(f"\nRL benchmark on {doc['cpu']}")
    sync = doc.get("served_sync", {})
    if sync and "error" not in sync:
        print(f"\n{'served sync (SmolLM2-135M f32)':34s} {'sync_s':>8s} {'transfer':>9s} {'apply':>8s} "
              f"{'pack':>7s} {'GB/s':>6s} {'driver':>8s}")
        for ops, ways in sync.items():
            for way, r in ways.items():
                print(f"  {ops + ' / ' + way:32s} {r['sync_s']:8.3f} {r.get('transfer_s_median', 0):9.3f} "
                      f"{r.get('apply_s_median', 0):8.3f} {r.get('pack_s_median', 0):7.3f} {r['gb_per_s']:6.2f} "
                      f"{r.get('driver_wall_s_median', 0):8.3f}")
    for k, g in doc.get("goals", {}).items():
        print(f"  goal {k}: {g['value']:.3f} s < {g['goal']} s: {'met' if g['met'] else 'NOT met'}")
    sizes = doc.get("size_curve", {})
    if sizes and "error" not in sizes:
        print(f"\n{'offline update_weights':34s} {'params':>8s} {'GB':>6s} {'total_s':>8s} {'load_s':>7s} "
              f"{'pack_s':>7s} {'GB/s':>6s}")
        for name, r in sizes.items():
            if "error" in r:
                print(f"  {name:32s} FAILED: {r['error']}")
                continue
            print(f"  {name:32s} {r['params'] / 1e6:7.0f}M {r['num_bytes'] / GB:6.2f} {r['sync_s']:8.3f} "
                  f"{r.get('load_s_median', 0):7.3f} {r.get('pack_s_median', 0):7.3f} {r['gb_per_s']:6.2f}")
    sl = doc.get("sleep", {})
    if sl and "error" not in sl:
        s = sl["sleep"]
        print(f"\nsleep(1): RSS freed {s.get('rss_freed', 0) / MIB:.0f} MiB of a {s.get('kv_cache_bytes', 0) / MIB:.0f}"
              f" MiB KV cache ({sl['rss_freed_over_kv']:.2f}x), sleep {sl['sleep_s']:.3f} s, wake_up "
              f"{sl['wake_up_s']:.3f} s, first token {sl['first_token_before_s']:.3f} s before / "
              f"{sl['first_token_after_wake_s']:.3f} s after wake ({sl['first_token_after_wake_2nd_s']:.3f} s the 2nd)")
    ro = doc.get("rollout", {})
    if ro and "error" not in ro:
        f, u = ro["fixed"], ro["updated"]
        print(f"\nrollout ({f['steps']} steps x {doc['args']['prompts']} prompts x {doc['args']['tokens']} tokens): "
              f"fixed {f['tok_s']:.1f} tok/s, with updates {u['tok_s']:.1f} tok/s "
              f"({ro['ratio_updated_over_fixed']:.2f}x; updates {u['update_s']:.2f} s of {u['wall_s']:.2f} s; "
              f"gen-only {u['gen_only_tok_s']:.1f} tok/s)")


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    sync = doc.get("served_sync", {})
    if sync and "error" not in sync:
        labels = [f"{ops}\n{way}" for ops, ways in sync.items() for way in ways]
        rows = [r for ways in sync.values() for r in ways.values()]
        transfer = [r.get("transfer_s_median", 0) for r in rows]
        apply_ = [r.get("apply_s_median", 0) for r in rows]
        a1.bar(labels, transfer, label="transfer")
        a1.bar(labels, apply_, bottom=transfer, label="apply (re-pack)")
        a1.axhline(GOAL_OBJECT_STORE_S, color="red", ls="--", label=f"goal {GOAL_OBJECT_STORE_S} s (object store)")
        a1.set_ylabel("seconds (median)")
        a1.set_title("served weight sync, SmolLM2-135M f32", fontsize=9)
        a1.legend(fontsize=8)
    sizes = {k: v for k, v in doc.get("size_curve", {}).items() if "error" not in v}
    for ops in doc["args"]["cpu_ops"]:
        pts = sorted((v["params"] / 1e9, v["sync_s"]) for k, v in sizes.items() if k.endswith("/" + ops))
        if pts:
            a2.plot(*zip(*pts, strict=True), marker="o", label=f"offline update_weights, cpu_ops={ops}")
    a2.set_xlabel("parameters (billions, float32)")
    a2.set_ylabel("seconds (median)")
    a2.set_title("sync time vs model size", fontsize=9)
    a2.legend(fontsize=8)
    fig.suptitle(f"RL rollout controls — {doc['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="timed updates per way (median); one warm-up before")
    p.add_argument("--cpu-ops", nargs="+", default=["auto", "torch"], choices=["auto", "torch"])
    p.add_argument("--sizes", nargs="*", default=["0.25B", "0.9B"], choices=sorted(SIZES),
                   help="random models of the size curve, after the bundled one")
    p.add_argument("--steps", type=int, default=4, help="rollout steps per loop")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--sleep-kv-mib", type=int, default=512)
    p.add_argument("--skip", nargs="*", default=[], choices=["served_sync", "size_curve", "sleep", "rollout"])
    p.add_argument("--quick", action="store_true", help="1 rep, a tiny random model, 2 rollout steps")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results" / "rl")
    args = p.parse_args()
    if args.quick:
        args.reps, args.sizes, args.steps, args.sleep_kv_mib = 1, ["tiny"], 2, 128
    cpu = describe(native.supported_levels()[0])
    doc: dict[str, Any] = {"cpu": cpu, "args": {k: v for k, v in vars(args).items() if k != "out_dir"}}
    print(f"RL benchmark on {cpu}", flush=True)
    parts = {"served_sync": served_sync, "size_curve": size_curve, "sleep": sleep_bench, "rollout": rollout_bench}
    for name, fn in parts.items():
        if name not in args.skip:
            section(name, fn, args, doc)
    sync = doc.get("served_sync", {})
    doc["goals"] = {f"object_store_sync_s/{ops}": {"goal": GOAL_OBJECT_STORE_S, "value": w["object_store"]["sync_s"],
                                                   "met": w["object_store"]["sync_s"] < GOAL_OBJECT_STORE_S}
                    for ops, w in sync.items() if ops != "error"}  # fmt: skip
    print_tables(doc)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    plot(doc, args.out_dir / "rl.png")
    print(f"wrote {args.out_dir / 'results.json'} and rl.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
