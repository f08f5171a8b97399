"""The Ray Serve application builder.

``serve run cbserve.cluster.app:build_app model=/path/to/model tensor_parallel_size=2`` and a Serve config
YAML with ``import_path: cbserve.cluster.app:build_app`` and ``args:`` both work; ``args`` are the fields of
CBServeConfig (plus ``config: FILE`` to read them from YAML first).
"""

from __future__ import annotations

from typing import Any

from cbserve.cluster.config import CBServeConfig
from ray.serve import Application


def build_app(args: dict[str, Any] | None = None) -> Application:
    config = args if isinstance(args, CBServeConfig) else CBServeConfig.from_args(args)
    return build_app_from_config(config)


def build_app_from_config(config: CBServeConfig) -> Application:
    from cbserve.cluster.ingress import OpenAIIngress

    return OpenAIIngress.bind(config.model_dump())
