"""The one user configuration (``CBServeConfig``), shared by the served path (``cluster/``) and the offline ``LLM``
(``frontend/``): its fields and their rules, the checks against the model (``servable.py``), and what only makes
sense served (``offline.py``). Never imports ray, the cluster or the front end."""

from cbserve.config.servable import check_kv_capacity, check_servable, known_device, kv_block_bytes, servable_config
from cbserve.config.serve_config import (
    DEFAULT_MODEL_NAME,
    ROUTING_MODES,
    CBServeConfig,
    ConfigError,
    RoutingMode,
    connected_ray,
)

__all__ = ["DEFAULT_MODEL_NAME", "ROUTING_MODES", "CBServeConfig", "ConfigError", "RoutingMode", "check_kv_capacity",
           "check_servable", "connected_ray", "known_device", "kv_block_bytes", "servable_config"]
