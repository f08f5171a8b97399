"""How a pooling model (``runner: pooling``) turns its final hidden states into one embedding, read without torch
from the model folder's sentence-transformers files, as vLLM does:

- ``modules.json`` lists the modules: the Transformer (the model itself), a ``Pooling`` module whose
  ``1_Pooling/config.json`` names the pooling (``pooling_mode`` in sentence-transformers >= 5, the
  ``pooling_mode_*_token(s)`` flags before), an optional ``Normalize``; any other module (``Dense``, ...) is
  refused, as are the pooling modes cbserve does not compute (``weightedmean``, several modes at once,
  ``include_prompt: false``).
- Without ``modules.json``: the last token's hidden state, normalized (decoder embedding models such as
  Qwen3-Embedding or gte-Qwen2 are trained so).
- Matryoshka models (the ``dimensions`` request field): ``matryoshka_dimensions`` or ``is_matryoshka`` in
  ``config.json`` (vLLM's keys) or in ``config_sentence_transformers.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

PoolingType = Literal["last", "cls", "mean", "max"]
POOLING_TYPES = ("last", "cls", "mean", "max")
# sentence-transformers' mode names (new and legacy) -> cbserve's
_ST_MODES = {"lasttoken": "last", "cls": "cls", "mean": "mean", "max": "max"}
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}  # fmt: skip


@dataclass(frozen=True)
class PoolingConfig:
    """``pooling_type`` over the prompt's final hidden states (after the final norm), then L2 normalization
    when ``normalize``. ``matryoshka``: the model may be cut to fewer dimensions (``dimensions``), to any of
    ``matryoshka_dimensions`` when given, else to any number up to its own."""

    pooling_type: PoolingType = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"  # where it was read: "default" or "sentence-transformers"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")


def read_pooling_config(folder: Path | None) -> PoolingConfig:
    """The pooling of the model in ``folder`` (None, or a GGUF file's folder without the files: the default).
    Raises ValueError for a sentence-transformers pipeline cbserve cannot run."""
    if folder is None or not folder.is_dir():
        return PoolingConfig()
    matryoshka, dims = _matryoshka(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(matryoshka=matryoshka, matryoshka_dimensions=dims)
    pooling: PoolingType | None = None
    normalize = False
    for module in _read_json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _pooling_type(_read_json(folder / str(module.get("path", "")) / "config.json"))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"{modules_file}: the sentence-transformers module {module.get('type')!r} is not "
                             "supported (cbserve runs Transformer, Pooling and Normalize)")
    if pooling is None:
        raise ValueError(f"{modules_file} has no Pooling module")
    return PoolingConfig(pooling, normalize, matryoshka, dims, "sentence-transformers")


def _pooling_type(config: dict[str, Any]) -> PoolingType:
    """The one pooling mode of a ``1_Pooling/config.json``."""
    mode: Any = config.get("pooling_mode")
    if mode is None:
        modes = [name for flag, name in _LEGACY_FLAGS.items() if config.get(flag)]
        mode = modes if len(modes) != 1 else modes[0]
        mode = mode or "mean"  # sentence-transformers' default
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_MODES:
        raise ValueError(f"the sentence-transformers pooling mode {mode!r} is not supported "
                         f"(supported: {', '.join(_ST_MODES)})")
    if config.get("include_prompt", True) is False:
        raise ValueError("sentence-transformers pooling with include_prompt=false is not supported")
    return _ST_MODES[mode]  # type: ignore[return-value]


def _matryoshka(folder: Path) -> tuple[bool, tuple[int, ...] | None]:
    """Whether the model may be cut to fewer dimensions, and to which (None: any)."""
    for name in ("config.json", "config_sentence_transformers.json"):
        path = folder / name
        config = _read_json(path) if path.is_file() else {}
        dims = config.get("matryoshka_dimensions") if isinstance(config, dict) else None
        if isinstance(dims, list) and dims:
            if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
                raise ValueError(f"{path}: matryoshka_dimensions must be positive integers, got {dims!r}")
            return True, tuple(sorted(dims))
        if isinstance(config, dict) and config.get("is_matryoshka") is True:
            return True, None
    return False, None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
