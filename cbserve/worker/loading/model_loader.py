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

CONVERT_SHARD_BYTES = 256 << 20  # a converted GGUF's shards: small, so that a shard held while it fills stays small


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

    from cbserve.worker.cpu.gguf_blocks import save_gguf_blocks

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
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            bar.update()
            blocks, num_weights = _write_weights(gguf, config, tmp)
            bar.update()
            save_gguf_blocks(tmp, blocks)
            logger.info("kept the GGUF blocks of %d of %d weights", len(blocks), num_weights)
            bar.update()
            (tmp / COMPLETE_MARKER).write_text(str(gguf.resolve()))
            bar.update()
        with contextlib.suppress(OSError):  # another process may have finished first: keep theirs
            os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (target / COMPLETE_MARKER).exists():
        raise RuntimeError(f"GGUF conversion of {gguf} did not produce {target}")
    return target


def _write_weights(gguf: Path, config: Any, folder: Path) -> tuple[dict[str, Any], int]:
    """Dequantize ``gguf`` into safetensors shards in ``folder`` one tensor at a time (at the peak: one tensor, a
    shard being filled and the quantized blocks kept), checking each against the model's names and shapes; the
    GGUF blocks of the weights that have them (an empty dict when the blocks cannot be read: they are optional)."""
    from gguf import GGUFReader

    from cbserve.worker.cpu.gguf_blocks import BlockExtractor

    reader, skeleton = GGUFReader(str(gguf)), _skeleton(config)  # one of each for the weights and their blocks
    extractor: BlockExtractor | None = None
    try:
        extractor = BlockExtractor(reader, config)
    except Exception as e:  # noqa: BLE001 (the blocks are optional: a reader failure must not fail the conversion)
        _blocks_lost(gguf, e)
    want = _model_shapes(skeleton, config)
    blocks, got = {}, {}
    with ShardWriter(folder, CONVERT_SHARD_BYTES) as writer:
        for name, tensor in dequantized_tensors(gguf, config, reader, skeleton):
            got[name] = tuple(tensor.shape)
            if want.get(name) != got[name]:
                break  # named below
            try:
                found = extractor.take(name, tensor) if extractor is not None else None
            except Exception as e:  # noqa: BLE001 (as above: all blocks dropped, the weights stay dense)
                _blocks_lost(gguf, e)
                extractor, found = None, None
                blocks.clear()
            if found is not None:
                blocks[name] = found
            writer.add(name, tensor)
    _check_names(gguf, got, want)
    return blocks, len(got)


def _blocks_lost(gguf: Path, e: Exception) -> None:
    logger.warning("GGUF blocks of %s not kept (%s: %s); weights stay float32", gguf, type(e).__name__, e)


def _skeleton(config: Any) -> Any:
    """The HF model built on the meta device (no memory): its weights' names and shapes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _model_shapes(skeleton: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """The model's weights' names and shapes; a tied LM head left out."""
    want = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        want.pop("lm_head.weight", None)
    return want


def _check_names(gguf: Path, got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> None:
    if got != want:
        differ = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
        raise RuntimeError(f"{gguf}: transformers' GGUF tensors are not the model's; these differ: {differ[:8]}")


def dequantized_tensors(gguf: Path, config: Any, reader: Any = None, skeleton: Any = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """The float32 weights of ``gguf`` under the HF model's names, one at a time: transformers' GGUF loader's own
    loop (its dequantization, its per-architecture tensor processors and name map), each tensor given out as it is
    made instead of gathered (a processor that assembles tensors, as a mixture of experts' merged experts, keeps
    those until the end). A tied LM head is left out. ``reader``, ``skeleton``: the file's ``GGUFReader`` and the
    model on the meta device, when the caller has them."""
    import numpy as np
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    from cbserve.worker.cpu.gguf_blocks import dequantize_rows

    skeleton = skeleton if skeleton is not None else _skeleton(config)
    reader = reader if reader is not None else GGUFReader(str(gguf))
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)  # the metadata its processors read
    parsed["tensors"] = {}
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed.get("config", {}))
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    tied = getattr(config, "tie_word_embeddings", False)
    for tensor in reader.tensors:
        result = processor.process(weights=dequantize_rows(tensor.data, tensor.tensor_type), name=tensor.name,
                                   tensor_key_mapping=mapping, parsed_parameters=parsed)  # fmt: skip
        if result.name in mapping and not (tied and mapping[result.name] == "lm_head.weight"):
            weights = result.weights  # (an array of its own unless a processor gave a view of the file: copied then)
            owned = isinstance(weights, np.ndarray) and weights.flags.writeable and weights.flags.owndata
            tensor = torch.from_numpy(weights if owned else np.copy(weights))
            yield mapping[result.name], tensor.to(torch.float32).contiguous()
    for name, tensor in parsed.pop("tensors").items():  # assembled by a processor
        if not (tied and name == "lm_head.weight"):
            yield name, tensor.to(torch.float32).contiguous()


def dequantized_state(gguf: Path, config: Any) -> dict[str, torch.Tensor]:
    """``dequantized_tensors`` gathered and checked against the model's names and shapes (RuntimeError naming the
    tensors that differ)."""
    skeleton = _skeleton(config)
    state = dict(dequantized_tensors(gguf, config, skeleton=skeleton))
    _check_names(gguf, {k: tuple(v.shape) for k, v in state.items()}, _model_shapes(skeleton, config))
    return state


class ShardWriter:
    """Safetensors shards of about ``shard_bytes`` written as tensors are added, with their index on ``close``; a
    shard's tensors are let go once it is written."""

    def __init__(self, folder: Path, shard_bytes: int = 1 << 30) -> None:
        self.folder, self.shard_bytes = folder, shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.size, self.files = 0, 0
        self.weight_map: dict[str, str] = {}

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.shard[name] = tensor
        self.size += tensor.nbytes
        if self.size >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.shard:
            return
        self.files += 1
        file = f"model-{self.files:05d}.safetensors"
        save_file(self.shard, str(self.folder / file), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.shard, file))
        self.shard, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        index = {"metadata": {}, "weight_map": self.weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index))


def save_sharded(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int = 1 << 30) -> None:
    """Write ``state`` to ``folder`` as safetensors shards of about ``shard_bytes`` with their index, removing each
    tensor from ``state`` as it goes (the memory of a written shard is freed)."""
    with ShardWriter(folder, shard_bytes) as writer:
        for name in list(state):
            writer.add(name, state.pop(name))


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
