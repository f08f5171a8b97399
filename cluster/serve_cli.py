"""``cbserve serve``: start (or join) Ray, deploy the OpenAI-compatible app, print where it listens and block
until Ctrl-C. Every CBServeConfig field is a flag (``--tensor-parallel-size 2``); ``--config FILE`` reads
them from YAML first (flags override it). Defaults, the port included, come from CBServeConfig."""

from __future__ import annotations

import argparse
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from cbserve.cluster.config import CBServeConfig

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of the fields below (or a Serve config YAML)")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join ('auto', 'local' or host:port); default: join a running one, else start one",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /health")
    for name, field in CBServeConfig.model_fields.items():
        default = field.default if field.default is not None else "auto"
        parser.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=None, help=f"(default: {default})"
        )


def config_from_args(args: argparse.Namespace) -> CBServeConfig:
    overrides = {n: getattr(args, n) for n in CBServeConfig.model_fields if getattr(args, n, None) is not None}
    if args.config:
        return CBServeConfig.from_yaml(args.config, **overrides)
    return CBServeConfig.from_args(overrides)


def init_ray(address: str | None) -> None:
    import ray

    if address is not None:
        ray.init(address=address)
        return
    try:
        ray.init(address="auto")
        logger.info("joined the running Ray cluster")
    except ConnectionError:
        ray.init()
        logger.info("started a local Ray cluster")


def wait_ready(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False


def main(args: argparse.Namespace) -> int:
    import ray
    from cbserve.cluster.app import build_app_from_config
    from ray import serve

    config = config_from_args(args)
    init_ray(args.ray_address)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(
        build_app_from_config(config), name=config.app_name, route_prefix=config.route_prefix, blocking=False
    )
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    prefix = config.route_prefix.rstrip("/")
    base = f"http://{host}:{config.port}{prefix}"
    print(f"cbserve: serving {config.model_name!r} at {base}/v1 (OpenAI API); health at {base}/health", flush=True)
    if wait_ready(f"{base}/health", args.ready_timeout):
        print("cbserve: engine replicas ready; Ctrl-C to stop", flush=True)
    else:
        print(f"cbserve: not ready after {args.ready_timeout:.0f}s; see {base}/health", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("cbserve: shutting down", flush=True)
    finally:
        _shutdown(serve, ray, config)
    return 0


def _shutdown(serve: Any, ray: Any, config: CBServeConfig) -> None:
    try:
        serve.delete(config.app_name)
    finally:
        ray.shutdown()
