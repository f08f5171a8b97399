"""What the front end reads of a model, without importing torch: the folder holding its tokenizer, and the
numbers of its ``config.json`` / ``generation_config.json`` that requests are checked against (EOS ids,
context length, vocabulary size), read as plain JSON.

A GGUF file has no tokenizer folder until it is converted (``worker/model_loader.convert_gguf``, once,
into a cache keyed by the file). The conversion needs torch, so when the cache is not there yet the front end
runs it in a child process: the serving process itself never imports torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbserve.worker.loading.model_info import converted_folder, locate_model, read_eos_token_ids

_CONVERT = (
    "import sys\n"
    "from cbserve.worker.loading.model_loader import resolve_model\n"
    "print(resolve_model(sys.argv[1]).folder)\n"
)


@dataclass(frozen=True)
class ModelFiles:
    """A model's folder and the numbers the front end needs from it."""

    folder: Path
    eos_token_ids: tuple[int, ...]  # sorted; every id that ends a sequence
    max_position_embeddings: int | None  # None: the config does not say
    vocab_size: int | None


def model_folder(model: str | None) -> Path:
    """The HF folder of ``model`` (None = the bundled default, an HF folder, a GGUF file or a folder with
    one GGUF file); a GGUF file is converted (once) in a child process."""
    located = locate_model(model)
    if not located.is_gguf:
        return located.path
    return converted_folder(located.path) or convert_in_child(located.path)


def convert_in_child(gguf: Path) -> Path:
    """The converted folder of ``gguf``, made by a child Python process (torch stays out of this one)."""
    proc = subprocess.run([sys.executable, "-c", _CONVERT, str(gguf)], capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"could not convert {gguf} to a model folder (exit {proc.returncode}): {tail}")
    return Path(lines[-1])


def read_model_files(folder: Path) -> ModelFiles:
    """Read ``folder``'s config.json (and generation_config.json when present)."""
    config = json.loads((folder / "config.json").read_text())
    return ModelFiles(
        folder=folder,
        eos_token_ids=read_eos_token_ids(folder),
        max_position_embeddings=_positive_int(config.get("max_position_embeddings")),
        vocab_size=_positive_int(config.get("vocab_size")),
    )


def _positive_int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
