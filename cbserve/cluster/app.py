"""The Ray Serve application builder.

``serve run cbserve.cluster.app:build_app model=/path/to/model tensor_parallel_size=2`` and a Serve config
YAML with ``import_path: cbserve.cluster.app:build_app`` and ``args:`` both work; ``args`` are the fields of
CBServeConfig (plus ``config: FILE`` to read them from YAML first). The configuration is checked against
the model here (``servable_config``), so a deployment that could never serve fails to build with one
message instead of starting engines that cannot load.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from cbserve.config import CBServeConfig, known_device, servable_config
from cbserve.config.autoscaling import serve_options

DRAIN_POLL_S = 0.2  # how often a replica Serve stops looks for requests still in flight


def build_app(args: dict[str, Any] | CBServeConfig | None = None) -> Application:
    config = args if isinstance(args, CBServeConfig) else CBServeConfig.from_args(args)
    return build_app_from_config(servable_config(config, known_device(config)))


def build_app_from_config(config: CBServeConfig) -> Application:
    """The app of an already checked configuration (``servable_config``)."""
    from cbserve.cluster.ingress.deployment import OpenAIIngress

    # Serve's own drain of a replica it stops (rollouts, scale-down) gives requests in flight as long, looking for
    # them every DRAIN_POLL_S (Serve's default, 2 s, is the least a stop of an idle replica took); with
    # ``autoscaling`` Serve's autoscaler sets the number of ingress replicas (config/autoscaling.py)
    options = {"graceful_shutdown_timeout_s": config.shutdown_timeout + 5.0,
               "graceful_shutdown_wait_loop_s": DRAIN_POLL_S, **serve_options(config.autoscaling)}
    return OpenAIIngress.options(**options).bind(config.model_dump())
