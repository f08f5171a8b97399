"""The model registry: which family module of this package builds a checkpoint, found without torch.

A family is one module here that states, as literals, the ``config.json`` ``model_type`` values and the
``architectures`` it serves (``MODEL_TYPES = (...)``, ``ARCHITECTURES = (...)``) and defines ``MODEL``, its
``nn.Module`` class. The registry reads those two literals from the module's source (no import), so
``model_info.SUPPORTED_MODEL_TYPES`` and the cluster's start-up checks need no torch; ``model_class``
imports the family only when a model is built. Adding an architecture is one file here plus its test.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FOLDER = Path(__file__).parent
_DECLARED = ("MODEL_TYPES", "ARCHITECTURES")


@dataclass(frozen=True)
class Family:
    module: str  # the module's name in this package
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]


def _declared(path: Path) -> dict[str, tuple[str, ...]]:
    """The module-level ``MODEL_TYPES`` / ``ARCHITECTURES`` literals of one source file."""
    found: dict[str, tuple[str, ...]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id in _DECLARED and node.value is not None:
                    found[t.id] = tuple(str(v) for v in ast.literal_eval(node.value))
    return found


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family module of this package (the modules that declare ``MODEL_TYPES``), by name."""
    out = []
    for path in sorted(_FOLDER.glob("*.py")):
        declared = _declared(path)
        if "MODEL_TYPES" in declared:
            out.append(Family(path.stem, declared["MODEL_TYPES"], declared.get("ARCHITECTURES", ())))
    return tuple(out)


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for f in families() for t in f.model_types)


def family_for(model_type: str, architectures: Sequence[str] | None = None) -> Family:
    """The family serving ``model_type`` (else one naming one of ``architectures``); NotImplementedError
    naming what is supported when none does."""
    for f in families():
        if model_type in f.model_types:
            return f
    for f in families():
        if any(a in f.architectures for a in architectures or ()):
            return f
    raise NotImplementedError(
        f"model_type {model_type!r} (architectures {list(architectures or [])}) is not supported; supported "
        f"model types: {', '.join(supported_model_types())}"
    )


def model_class(hf_config: Any) -> type:
    """The ``nn.Module`` class that builds ``hf_config``'s model (imports its family module)."""
    family = family_for(str(getattr(hf_config, "model_type", "")), getattr(hf_config, "architectures", None))
    return importlib.import_module(f"{__package__}.{family.module}").MODEL
