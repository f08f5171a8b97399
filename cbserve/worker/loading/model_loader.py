"""Find and load model weights: HF folders (config.json + safetensors, sharded or not) and GGUF files.

GGUF files are dequantized once through transformers' GGUF support and the result (config, weights,
tokenizer with its chat template) is cached as an HF safetensors folder under ``$CBSERVE_CACHE_DIR``
(default ``~/.cache/cbserve``), keyed by the file's path, size and mtime; later loads read the cache. The
folder also keeps the quantized blocks of the weights that have them (``cpu/gguf_blocks.py``), which the native
CPU kernels read instead of the dense float32 copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cbserve.worker.loading.gguf_arch import gguf_config_fixes, gguf_model_type
from cbserve.worker.loading.model_info import COMPLETE_MARKER, gguf_cache_folder, locate_model, read_gguf_metadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedModel:
    """An HF-style folder to load from (a GGUF file is resolved to its converted cache folder)."""

    folder: Path
    source: str  # what the user asked for (path), for names and messages


def resolve_model(model: str | None) -> ResolvedModel:
    """Turn ``model`` (None, an HF folder, a GGUF file or a folder holding one GGUF) into an HF folder."""
    located = locate_model(model)
    folder = convert_gguf(located.path) if located.is_gguf else located.path
    return ResolvedModel(folder, located.source)


def convert_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` into a cached HF folder (once); returns the folder. ValueError for a GGUF
    architecture cbserve does not load (``gguf_arch.py``), before transformers reads a tensor."""
    target = gguf_cache_folder(gguf)
    if (target / COMPLETE_MARKER).exists():
        return target
    meta = read_gguf_metadata(gguf, wanted=lambda key: not key.startswith("tokenizer."))
    gguf_model_type(meta, gguf)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from cbserve.worker.cpu.gguf_blocks import extract_gguf_blocks, save_gguf_blocks

    logger.info("converting %s to safetensors in %s (first load only)", gguf, target)
    folder, name = str(gguf.parent), gguf.name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with tqdm(total=4, desc=f"Converting {name}", unit="step") as bar:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            for key, value in gguf_config_fixes(meta).items():  # values transformers' loader drops
                setattr(config, key, value)
            AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
            bar.update()
            state = dequantized_state(gguf, config)  # a tied LM head left out
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            bar.update()
            try:
                blocks = extract_gguf_blocks(gguf, config, state)
            except Exception as e:  # noqa: BLE001 (optional: a reader failure must not fail the conversion)
                logger.warning("GGUF blocks of %s not kept (%s: %s); weights stay float32", gguf, type(e).__name__, e)
                blocks = {}
            save_gguf_blocks(tmp, blocks)
            logger.info("kept the GGUF blocks of %d of %d weights", len(blocks), len(state))
            bar.update()
            save_sharded(state, tmp)  # empties ``state`` shard by shard
            (tmp / COMPLETE_MARKER).write_text(str(gguf.resolve()))
            bar.update()
        with contextlib.suppress(OSError):  # another process may have finished first: keep theirs
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (target / COMPLETE_MARKER).exists():
        raise RuntimeError(f"GGUF conversion of {gguf} did not produce {target}")
    return target


def dequantized_state(gguf: Path, config: Any) -> dict[str, torch.Tensor]:
    """The float32 weights of ``gguf`` under the HF model's names, read by transformers' GGUF loader into one
    dictionary (the model itself built on the meta device: no second copy). RuntimeError naming the tensors when
    they are not exactly the model's own names and shapes."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    want = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    if getattr(config, "tie_word_embeddings", False):
        want.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != want:
        differ = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
        raise RuntimeError(f"{gguf}: transformers' GGUF tensors are not the model's; these differ: {differ[:8]}")
    return {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}


def save_sharded(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int = 1 << 30) -> None:
    """Write ``state`` to ``folder`` as safetensors shards of about ``shard_bytes`` with their index, removing each
    tensor from ``state`` once its shard is written (the memory of a written shard is freed)."""
    from safetensors.torch import save_file

    names, weight_map, files = list(state), {}, 0
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for i, name in enumerate(names):
        shard[name] = state.pop(name)
        size += shard[name].nbytes
        if size >= shard_bytes or i == len(names) - 1:
            files += 1
            file = f"model-{files:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def hide_triton_from_torch() -> None:
    """Import ``torch._dynamo`` while ``import triton`` fails, so that torch records "no Triton" for good.

    For a CPU worker, before transformers is used: its config classes import ``torch._dynamo`` (through
    ``torch.compiler.disable``), whose import calls ``torch.utils._triton.has_triton_package()``, which
    imports triton when it is installed; triton is of no use without CUDA and its bindings print a page of
    "leaked function" lines at exit. Code that uses Triton itself (the CUDA backends, the interpreter
    tests) still imports it normally afterwards. Nothing happens once torch._dynamo or triton is loaded.
    """
    if "torch._dynamo" in sys.modules or "triton" in sys.modules:
        return
    sys.modules["triton"] = None  # type: ignore[assignment]  # makes `import triton` raise ImportError
    try:
        import torch._dynamo  # noqa: F401
    finally:
        if "triton" in sys.modules and sys.modules["triton"] is None:
            del sys.modules["triton"]


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return files


def iter_weights(folder: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of the folder's safetensors files, with a progress bar."""
    from safetensors import safe_open

    files = _safetensors_files(folder)
    with tqdm(desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, sf.get_tensor(name)
                    bar.update()
