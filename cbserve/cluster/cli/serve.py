"""``cbserve serve``: start (or join) Ray, deploy the OpenAI-compatible app, print where it listens and block
until Ctrl-C. Every CBServeConfig field is a flag (``--tensor-parallel-size 2``); ``--config FILE`` reads
them from YAML first (flags override it). Defaults, the port included, come from CBServeConfig.

A configuration that could never serve (bad values, or values the model disagrees with: see
``config.servable_config``) ends the command with one ``cbserve: error: ...`` line and exit status 1,
before Serve starts; so does an engine replica that fails to build (its error is printed).

SIGINT (Ctrl-C) and SIGTERM stop it at any stage, with exit status 0 (a stop that was asked for): during start-up
(Ray starting, the engines loading the model) what was started is shut down (the app, Serve, Ray) and the stage
printed; once the app is ready the ingress replicas drain first (``drain``: the handle it takes, warmed while the
app is idle, so the refusals start as the signal arrives), then Serve and Ray shut down."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import pydantic

from cbserve.cluster.cli import say
from cbserve.cluster.cli.serve_stop import STOP, Started, StopRequested, app_handle, drain, warm
from cbserve.cluster.ops.metrics_discovery import write_for_local_ray
from cbserve.cluster.ops.node_tuning import NodeTuning, environment_for_ray, node_tuning
from cbserve.config import CBServeConfig, known_device, servable_config
from cbserve.config.autoscaling import starts_at_zero

logger = logging.getLogger(__name__)

# flags that take more than one value, and how (vLLM's forms)
_FLAG_FORMS: dict[str, dict[str, Any]] = {
    "lora_modules": {"nargs": "+", "metavar": "NAME=PATH",
                     "help": 'adapters served from the start: name=path or {"name": ..., "path": ...} '
                             "(needs --enable-lora)"},
    "lora_allowed_dirs": {"nargs": "+", "metavar": "DIR",
                          "help": "folders /v1/load_lora_adapter may read adapters from (needs "
                                  "--allow-runtime-lora-updating)"},
    "disaggregation": {"metavar": "P:D|JSON", "help": "prefill/decode disaggregation: P prefill and D decode engine "
                       "replicas (P:D), or a JSON object of config/pd_config.py's keys"},
}
_ALIASES = {"disaggregation": ("--pd",)}  # --pd 1:1: a P:D app (config/pd_config.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of the fields below (or a Serve config YAML)")
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster to join ('auto', 'local' or host:port); default: join a running one, else start one",
    )
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument(
        "--direct-ingress",
        choices=("auto", "true", "false"),
        default="auto",
        help="true: the ingress replica answers HTTP on --port itself, without Serve's HTTP proxy in the path "
        "(one Ray streaming hop less per streamed token; Ray Serve's RAY_SERVE_ENABLE_DIRECT_INGRESS); it needs "
        "the Ray instance this command starts, and one ingress replica (no --autoscaling). auto (default): so when "
        "this command starts Ray without --autoscaling, through the proxy when it joins a running cluster or "
        "autoscales (the proxy queues requests while a replica starts). false: always through the proxy",
    )
    parser.add_argument(
        "--ray-dashboard",
        action="store_true",
        help="start Ray's dashboard (:8265) with the Ray instance this command starts. Off by default: on a "
        "small node its dozen processes took ~3%% of the served throughput; the metrics are exported all the "
        "same, and this command writes Prometheus's service-discovery file itself. A running cluster that is "
        "joined keeps its own dashboard setting",
    )
    for name, field in CBServeConfig.model_fields.items():
        default = field.default if field.default is not None else "auto"
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": f"(default: {default})"}
        if field.annotation is bool:  # `--enable-lora` alone means true (as vLLM's flags); a value still works
            kwargs |= {"nargs": "?", "const": "true"}
        kwargs |= _FLAG_FORMS.get(name, {})
        parser.add_argument("--" + name.replace("_", "-"), *_ALIASES.get(name, ()), **kwargs)


def config_from_args(args: argparse.Namespace) -> CBServeConfig:
    overrides = {n: getattr(args, n) for n in CBServeConfig.model_fields if getattr(args, n, None) is not None}
    if args.config:
        return CBServeConfig.from_yaml(args.config, **overrides)
    return CBServeConfig.from_args(overrides)


def direct_ingress_env(port: int) -> dict[str, str]:
    """What Ray Serve reads at start-up to serve the ingress replica's HTTP on ``port`` itself (one ingress
    replica; its drain on shutdown not held open for a load balancer that is not there)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def init_ray(address: str | None, include_dashboard: bool = False) -> bool:
    """Join or start Ray; True when this process started the Ray instance (with Ray's dashboard only when
    ``include_dashboard``)."""
    import ray

    if address == "local":
        ray.init(address=address, include_dashboard=include_dashboard)
        return True
    if address is not None:
        ray.init(address=address)
        return False
    try:
        ray.init(address="auto")
        logger.info("joined the running Ray cluster")
        return False
    except ConnectionError:
        ray.init(include_dashboard=include_dashboard)
        logger.info("started a local Ray cluster")
        return True


def start_ray(args: argparse.Namespace, port: int, tuning: NodeTuning, autoscaled: bool = False) -> tuple[bool, bool]:
    """Ray for ``cbserve serve``: (this command started the Ray instance, the ingress serves HTTP itself
    (``--direct-ingress``; never when ``autoscaled``: Serve's proxy fronts the replicas, and queues requests
    while one starts)). What Ray reads when its processes start (direct ingress, and the node-tuning
    profile's settings: cluster/ops/node_tuning.py) is in the environment only while Ray starts; a running cluster
    that is joined keeps its own settings."""
    wanted = args.direct_ingress != "false" and not autoscaled
    env = {**tuning.ray_env, **(direct_ingress_env(port) if wanted else {})}
    with environment_for_ray(env):
        try:
            started = init_ray("local" if args.direct_ingress == "true" else args.ray_address, args.ray_dashboard)
        except SystemExit as e:  # Ray's own SIGTERM handler, in place while ray.init runs: a stop all the same
            raise StopRequested("SIGTERM") from e
        finally:
            STOP.reinstall()  # ray.init put its own SIGTERM handler in place of this command's
    direct = wanted and started
    if not started and args.ray_dashboard:
        logger.warning("--ray-dashboard: joined a running Ray cluster, which keeps its own dashboard setting")
    logger.info("HTTP served by %s", "the ingress replica (direct ingress)" if direct else "Serve's proxy")
    return started, direct


def checked_config(args: argparse.Namespace) -> CBServeConfig:
    """The configuration of the flags, checked against the model where that needs no Ray (ConfigError /
    pydantic.ValidationError otherwise)."""
    config = config_from_args(args)
    return servable_config(config, known_device(config))


def error_message(e: Exception) -> str:
    """One line for a configuration error (pydantic's report is a multi-line table)."""
    if isinstance(e, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
    return str(e)


def _fail(message: str) -> int:
    say(f"cbserve: error: {message}", sys.stderr)
    return 1


def wait_ready(base: str, timeout_s: float, api_key: str | None = None) -> tuple[bool, str | None]:
    """Until /health says ready ``(True, None)``, an engine replica failed for good ``(False, its
    error)``, or timeout ``(False, None)``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return True, None
        except urllib.error.HTTPError:
            failed = _failed_replicas(base, api_key)
            if failed:
                return False, failed
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False, None


def _replica_stats(base: str, api_key: str | None) -> list[dict[str, Any]]:
    """/stats' engine replicas; none when it does not answer."""
    req = urllib.request.Request(f"{base}/stats")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return list(json.loads(r.read()).get("replicas", []))
    except (urllib.error.URLError, OSError, ValueError):
        return []


def _failed_replicas(base: str, api_key: str | None) -> str | None:
    replicas = _replica_stats(base, api_key)
    errors = [f"engine replica {r.get('replica')}: {r.get('error')}" for r in replicas if r.get("state") == "failed"]
    return "; ".join(errors) or None


def main(args: argparse.Namespace) -> int:
    STOP.install()  # from the start: a stop while Ray starts or the engines load shuts down what was started
    started = Started()
    try:
        return _serve(args, started)
    except StopRequested as e:  # before the app was ready: nothing served yet, nothing to drain
        say(f"cbserve: shutting down ({e} during start-up, {started.stage})")
        started.shut_down()
        say("cbserve: stopped")
        return 0
    finally:
        started.shut_down()
        STOP.restore()


def _serve(args: argparse.Namespace, started: Started) -> int:
    try:
        config = checked_config(args)
    except ValueError as e:  # ConfigError, pydantic.ValidationError
        return _fail(error_message(e))
    refused = flags_refused(args, config)
    if refused:
        return _fail(refused)
    import ray
    from ray import serve

    from cbserve.cluster.app import build_app_from_config

    started.ray, started.serve, started.config = ray, serve, config
    started.enter("while Ray starts")
    tuning = node_tuning(config.node_tuning)
    logger.info("node tuning: %s", tuning.name)
    ray_started, direct = start_ray(args, config.port, tuning, config.autoscaling is not None)
    if ray_started and not args.ray_dashboard:  # what Ray's dashboard would have written
        try:
            logger.info("Prometheus service discovery file: %s", write_for_local_ray())
        except OSError as e:  # serving goes on; Prometheus then needs the metrics port configured by hand
            logger.warning("could not write Prometheus's service-discovery file: %s", e)
    try:
        if config.device == "auto":  # the cluster decided the device: the KV budget can be checked now
            started.config = config = servable_config(config, config.resolved_device)
    except ValueError as e:
        return _fail(error_message(e))
    started.enter("while Serve starts")
    # with direct ingress Serve still starts its proxy: it gets a port of its own, out of the path
    serve.start(http_options={"host": config.host, "port": 0 if direct else config.port})
    say("cbserve: deploying the app; its engine replicas load the model")
    started.enter("while the engine replicas load the model")
    started.deployed = True
    serve.run(  # returns once the ingress replicas are running: their engines loaded the model (or failed)
        build_app_from_config(config), name=config.app_name, route_prefix=config.route_prefix, blocking=False
    )
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    base = f"http://{host}:{config.port}{config.route_prefix.rstrip('/')}"
    say(f"cbserve: serving {config.model_name!r} at {base}/v1 (OpenAI API); health at {base}/health")
    started.enter("while waiting for /health")
    ready, failure = await_ready(args, config, base, tuning if ray_started else None)
    if failure is not None:
        return _fail(failure)
    started.enter("serving")
    stop, handle = _serve_until_stopped(serve, config, ready)
    say(f"cbserve: shutting down ({stop})")
    if handle is not None:
        drain(handle, config)
    return 0


def flags_refused(args: argparse.Namespace, config: CBServeConfig) -> str | None:
    """Why the command-line flags cannot work together (None when they can)."""
    if args.direct_ingress == "true" and args.ray_address not in (None, "local"):
        return ("--direct-ingress true needs the Ray instance `cbserve serve` starts (Ray Serve reads it "
                "when its processes start): leave --ray-address unset or 'local'")
    if args.direct_ingress == "true" and config.autoscaling is not None:
        return ("--direct-ingress true does not combine with autoscaling: each ingress replica would answer on a "
                "port of its own and none at zero replicas; Serve's proxy fronts autoscaled replicas and queues "
                "requests while one starts (--direct-ingress auto does that)")
    if args.ray_dashboard and args.ray_address not in (None, "local"):
        return ("--ray-dashboard applies to the Ray instance `cbserve serve` starts; the cluster at "
                f"--ray-address {args.ray_address} keeps its own dashboard setting")
    return None


def await_ready(
    args: argparse.Namespace, config: CBServeConfig, base: str, tuning: NodeTuning | None
) -> tuple[bool, str | None]:
    """Wait for /health (``wait_ready``) and say so; ``tuning``: the node-tuning profile, when this command started
    Ray. An app that starts scaled to zero is not woken up: its first request starts a replica. The engines go first
    on the CPU only without autoscaling: Ray may start later engines in its pooled worker processes, which the
    profile would have put behind them."""
    if starts_at_zero(config.autoscaling):
        say("cbserve: scaled to zero: the first request starts an ingress replica and its engines (requests wait "
            "for them); Ctrl-C to stop")
        return True, None
    ready, failure = wait_ready(base, args.ready_timeout, config.api_key)
    if failure is not None:
        return False, failure
    if ready:
        if tuning is not None and config.autoscaling is None:
            engines = [pid for r in _replica_stats(base, config.api_key) for pid in r.get("engine_pids", [])]
            tuning.engines_ready(os.getpid(), engines)
        say("cbserve: engine replicas ready; Ctrl-C to stop")
    else:
        say(f"cbserve: not ready after {args.ready_timeout:.0f}s; see {base}/health")
    return ready, None


def _serve_until_stopped(serve: Any, config: CBServeConfig, ready: bool) -> tuple[str, Any]:
    """Serve until SIGINT or SIGTERM: the signal's name, and the app's handle for the drain (None: no drain). The
    handle is warmed first (``serve_stop.warm``): the drain then starts as the signal arrives."""
    handle = None
    try:
        handle = app_handle(serve, config) if ready else None
        if handle is not None:
            warm(handle, config)
        return wait_for_stop(), handle
    except StopRequested as e:  # while the handle was taken or warmed: the drain builds what it needs
        return str(e), handle if handle is not None or not ready else app_handle(serve, config)


def wait_for_stop() -> str:
    """Block until SIGINT (Ctrl-C) or SIGTERM arrives (``STOP``, installed here unless it is already); the signal's
    name."""
    if STOP.received is not None:  # its interruption got lost
        return STOP.received
    if not STOP.installed:
        STOP.install()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as e:
        return str(e) or "SIGINT"
