"""Make a "layer-skip" self-draft for speculative decoding: copy a Hugging Face Llama-style folder keeping
only its first N decoder layers (default 6) plus the embeddings, final norm and LM head, so the draft
shares the target's tokenizer and vocabulary. No training: the truncated model's guesses are the target's
early layers read out by its own head. For SmolLM2-135M (30 layers) they rarely match the target's tokens
(6 layers: ~0% accepted; it takes ~24 layers for ~40%), so such a draft measures the draft path's cost
rather than a speed-up (BENCHMARKS.md).

Works on the safetensors files directly (no model class needed): every tensor ``model.layers.{i}.*`` with
``i >= N`` is dropped, ``num_hidden_layers`` (and ``layer_types`` when present) is cut to N, and every other
file of the folder (tokenizer, chat template, generation config) is copied.

    .venv/bin/python benchmarks/make_truncated_draft.py /path/to/SmolLM2-135M-Instruct /tmp/smollm2-draft6
    .venv/bin/python benchmarks/bench_spec.py --draft-model /tmp/smollm2-draft6 --concurrency 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", type=Path, help="Hugging Face model folder (config.json + *.safetensors)")
    p.add_argument("dest", type=Path, help="output folder (created; must not exist unless --force)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers to keep (the first N)")
    p.add_argument("--force", action="store_true", help="overwrite dest")
    return p.parse_args(argv)


def keep_tensor(name: str, layers: int) -> bool:
    m = LAYER.search(name)
    return m is None or int(m.group(1)) < layers


def truncated_config(config: dict, layers: int) -> dict:
    total = int(config["num_hidden_layers"])
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be in 1..{total} (the model has {total} decoder layers), got {layers}")
    out = {**config, "num_hidden_layers": layers}
    if isinstance(config.get("layer_types"), list):
        out["layer_types"] = config["layer_types"][:layers]
    return out


def truncate(source: Path, dest: Path, layers: int, force: bool = False) -> dict[str, int]:
    """Write the truncated model to ``dest``; return counts of tensors kept and dropped."""
    from safetensors.torch import load_file, save_file

    weights = sorted(source.glob("*.safetensors"))
    if not (source / "config.json").is_file() or not weights:
        raise FileNotFoundError(f"{source}: need config.json and *.safetensors (a Hugging Face model folder)")
    config = truncated_config(json.loads((source / "config.json").read_text()), layers)
    if dest.exists():
        if not force:
            raise FileExistsError(f"{dest} exists (pass --force to overwrite)")
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    tensors, dropped = {}, 0
    for f in weights:
        for name, t in load_file(str(f)).items():
            if keep_tensor(name, layers):
                tensors[name] = t.contiguous()
            else:
                dropped += 1
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dest / f.name)
    return {"kept": len(tensors), "dropped": dropped}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = truncate(args.source, args.dest, args.layers, args.force)
    print(f"wrote {args.dest}: first {args.layers} decoder layers, {counts['kept']} tensors kept, "
          f"{counts['dropped']} dropped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
