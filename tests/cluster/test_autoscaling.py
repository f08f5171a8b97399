"""``autoscaling`` (config/autoscaling.py): the flag's ``min=1,max=N,target_ongoing=K`` form, a Serve config's
``autoscaling_config``, the errors, and what reaches Serve (the built app's deployment options) and
``cbserve serve`` (the proxy instead of direct ingress; no wake-up of an app that starts at zero). No Ray runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pydantic
import pytest
import yaml

from cbserve.cluster.app import build_app_from_config
from cbserve.cluster.cli import serve as serve_cli
from cbserve.cluster.cli.serve import add_arguments, config_from_args
from cbserve.cluster.ops.node_tuning import node_tuning
from cbserve.config import CBServeConfig
from cbserve.config.autoscaling import SERVE_KEYS, ServeAutoscaling, parse_autoscaling, starts_at_zero


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_flag_form_becomes_serves_autoscaling_config() -> None:
    flag = "min=1,max=3,target_ongoing=2,upscale_delay_s=0.5,downscale_delay_s=4"
    config = config_from_args(_parse(["--autoscaling", flag]))
    assert config.autoscaling == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2.0,
                                  "upscale_delay_s": 0.5, "downscale_delay_s": 4.0}  # fmt: skip
    # Serve's own names, a JSON object (a `serve run ... autoscaling=...` arg) and a mapping agree
    same = '{"min_replicas": 1, "max": 3, "target_ongoing_requests": 2, "upscale_delay_s": 0.5, "downscale_delay_s": 4}'
    assert CBServeConfig.from_args({"autoscaling": same}).autoscaling == config.autoscaling
    assert CBServeConfig(autoscaling=dict(config.autoscaling), device="cpu").autoscaling == config.autoscaling
    # a config that went through model_dump (the ingress replica's copy) reads back the same
    assert CBServeConfig.model_validate(config.model_dump()) == config
    assert CBServeConfig(device="cpu").autoscaling is None
    assert CBServeConfig(autoscaling="none", device="cpu").autoscaling is None


def test_yaml_takes_autoscaling_from_args_or_from_serves_deployment_options(tmp_path: Path) -> None:
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"autoscaling": {"min": 0, "max": 2, "downscale_to_zero_delay_s": 5}}))
    assert CBServeConfig.from_yaml(plain).autoscaling == {"min_replicas": 0, "max_replicas": 2,
                                                          "downscale_to_zero_delay_s": 5.0}  # fmt: skip
    app = {"name": "cbserve", "import_path": "cbserve.cluster.app:build_app", "args": {"max_model_len": 256},
           "deployments": [{"name": "OpenAIIngress", "graceful_shutdown_timeout_s": 60,
                            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                   "target_ongoing_requests": 8}}]}  # fmt: skip
    serve_file = tmp_path / "serve.yaml"
    serve_file.write_text(yaml.safe_dump({"applications": [app]}))
    config = CBServeConfig.from_yaml(serve_file)
    assert config.max_model_len == 256
    assert config.autoscaling == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0}
    twice = dict(app, args={"autoscaling": "max=2"})
    serve_file.write_text(yaml.safe_dump({"applications": [twice]}))
    with pytest.raises(ValueError, match="autoscaling is set twice"):
        CBServeConfig.from_yaml(serve_file)
    fixed = dict(app, deployments=[dict(app["deployments"][0], num_replicas=2)])
    serve_file.write_text(yaml.safe_dump({"applications": [fixed]}))
    with pytest.raises(ValueError, match="both num_replicas and autoscaling_config"):
        CBServeConfig.from_yaml(serve_file)


@pytest.mark.parametrize(("bad", "match"), [
    ("min=3,max=2", r"max_replicas \(2\) must be greater than or equal to min_replicas \(3\)"),
    ("min=1,max=4,initial=6", r"max_replicas \(4\) must be greater than or equal to initial_replicas \(6\)"),
    ("max=2,maximum=3", "unknown key 'maximum'"),
    ("min=1,target_ongoing=2", "autoscaling needs max"),
    ("max=two", "max_replicas: Input should be a valid integer"),
    ("max=2,target_ongoing=0", "target_ongoing_requests: Input should be greater than 0"),
    ("max=2,min", "'min' is not key=value"),
    ("max=2,smoothing_factor=0.5", "deprecated by Serve"),
    ("max=2,policy=my.module:fn", "custom autoscaling policy is not supported"),
    ('{"max": 2', "not valid JSON"),
    (["max=2"], "key=value pairs or a mapping"),
])  # fmt: skip
def test_bad_autoscaling_is_refused_by_name(bad: object, match: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        CBServeConfig(autoscaling=bad, device="cpu")


SAME_AS_SERVE = [
    {"max_replicas": 2}, {"min_replicas": 0, "max_replicas": 3, "initial_replicas": 1},
    {"max_replicas": "4", "target_ongoing_requests": "1.5", "upscale_delay_s": 0, "downscale_delay_s": "2"},
    {"max_replicas": 2, "aggregation_function": "MAX", "look_back_period_s": 12, "metrics_interval_s": 2},
    {"max_replicas": 2, "upscaling_factor": 0.5, "downscaling_factor": 2, "downscale_to_zero_delay_s": 9},
    {"max_replicas": 2, "target_ongoing_requests": None, "initial_replicas": None},
    {"min_replicas": 3, "max_replicas": 2}, {"min_replicas": 2, "max_replicas": 4, "initial_replicas": 1},
    {"max_replicas": 4, "initial_replicas": 6}, {"max_replicas": 0}, {"max_replicas": "two"},
    {"max_replicas": 2, "min_replicas": -1}, {"max_replicas": 2, "target_ongoing_requests": 0},
    {"max_replicas": 2, "upscale_delay_s": -1}, {"max_replicas": 2, "aggregation_function": "median"},
    {"max_replicas": 2, "upscaling_factor": 0}, {"max_replicas": 1.5}, {"max_replicas": 2, "min_replicas": True},
]  # fmt: skip


@pytest.mark.parametrize("given", SAME_AS_SERVE)
def test_the_ray_free_rules_are_serves(given: dict[str, object]) -> None:
    """config/autoscaling.py checks ``autoscaling`` without ray by a copy of Serve's AutoscalingConfig rules: on the
    same input both accept with the same values, or both refuse (the replica-count messages word for word)."""
    import warnings

    from ray.serve.config import AutoscalingConfig

    assert set(AutoscalingConfig.model_fields) >= SERVE_KEYS
    for key in SERVE_KEYS:
        assert ServeAutoscaling.model_fields[key].default == AutoscalingConfig.model_fields[key].default, key
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Serve warns about metrics_interval_s
        try:
            expected = AutoscalingConfig.model_validate(given).model_dump(mode="json", include=set(given))
        except pydantic.ValidationError as e:
            with pytest.raises(pydantic.ValidationError) as mine:
                ServeAutoscaling.model_validate(given)
            if "replicas (" in str(e):
                assert e.errors()[0]["msg"] == mine.value.errors()[0]["msg"]
            return
    assert ServeAutoscaling.model_validate(given).model_dump(mode="json", include=set(given)) == expected


def test_the_built_app_carries_the_autoscaling_config() -> None:
    """What Serve gets, read off the Application without starting Ray: the autoscaling config on the ingress
    deployment (no fixed replica count), and the drain time it gives a replica it stops."""
    scaling_flag = "min=0,max=3,target_ongoing=4,upscale_delay_s=1,downscale_delay_s=2"
    config = CBServeConfig(device="cpu", shutdown_timeout=7, num_replicas=2, autoscaling=scaling_flag)
    deployment = build_app_from_config(config)._bound_deployment
    scaling = deployment._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (0, 3, 4.0)
    assert (scaling.upscale_delay_s, scaling.downscale_delay_s) == (1.0, 2.0)
    assert scaling.look_back_period_s == 30.0  # a key not given keeps Serve's default
    assert deployment._deployment_config.graceful_shutdown_timeout_s == 12.0  # scale-down drains first
    assert CBServeConfig.model_validate(deployment.init_args[0]).num_replicas == 2  # engines per ingress replica
    fixed = build_app_from_config(CBServeConfig(device="cpu"))._bound_deployment
    assert fixed._deployment_config.autoscaling_config is None and fixed.num_replicas == 1


def test_starts_at_zero_follows_initial_then_min_replicas() -> None:
    assert starts_at_zero(parse_autoscaling("min=0,max=2"))
    assert not starts_at_zero(parse_autoscaling("min=0,max=2,initial=1"))
    assert not starts_at_zero(parse_autoscaling("max=2")) and not starts_at_zero(None)


def test_autoscaling_goes_through_serves_proxy_and_refuses_direct_ingress_true(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--direct-ingress auto`` with autoscaling: the proxy (nothing of direct ingress in Ray's environment);
    ``true``: refused before Ray starts, saying why."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    seen: list[str | None] = []

    def init(address: str | None, dashboard: bool) -> bool:
        seen.append(os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS"))
        return True

    monkeypatch.setattr(serve_cli, "init_ray", init)
    args = argparse.Namespace(direct_ingress="auto", ray_address=None, ray_dashboard=False)
    assert serve_cli.start_ray(args, 8123, node_tuning("off"), autoscaled=True) == (True, False) and seen == [None]
    argv = ["--device", "cpu", "--direct-ingress", "true", "--autoscaling", "min=1,max=2"]
    assert serve_cli.main(_parse(argv)) == 1
    assert "--direct-ingress true does not combine with autoscaling" in capsys.readouterr().err


def test_cbserve_serve_deploys_autoscaled_and_does_not_wake_an_app_at_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cbserve serve --autoscaling min=0,...` with Ray and Serve faked: the proxy listens on --port, the app
    carries the autoscaling config, /health is not polled (that would start a replica), and a stop drains every
    ingress replica (a broadcast)."""
    import ray
    from ray import serve

    calls: dict[str, object] = {}
    monkeypatch.setattr(serve_cli, "start_ray", lambda args, port, tuning, autoscaled: calls.update(
        autoscaled=autoscaled) or (True, False))  # fmt: skip
    monkeypatch.setattr(serve_cli, "write_for_local_ray", lambda: "sd.json")
    monkeypatch.setattr(serve, "start", lambda http_options: calls.update(http=http_options))
    monkeypatch.setattr(serve, "run", lambda app, **kw: calls.update(app=app))
    monkeypatch.setattr(serve, "delete", lambda name: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(serve_cli, "wait_ready", lambda *a: calls.update(polled=True) or (True, None))
    broadcasts: list[str] = []
    drained = argparse.Namespace(results=lambda timeout_s: [])
    handle = argparse.Namespace(broadcast=lambda method: broadcasts.append(method) or drained)
    monkeypatch.setattr(serve, "get_app_handle", lambda name: handle)
    monkeypatch.setattr(serve_cli, "wait_for_stop", lambda: "SIGTERM")
    argv = ["--device", "cpu", "--port", "8123", "--max-model-len", "256", "--autoscaling", "min=0,max=2"]
    assert serve_cli.main(_parse(argv)) == 0
    assert calls["autoscaled"] is True and calls["http"] == {"host": "0.0.0.0", "port": 8123}
    assert "polled" not in calls and broadcasts == ["drain"]
    scaling = calls["app"]._bound_deployment._deployment_config.autoscaling_config  # type: ignore[attr-defined]
    assert (scaling.min_replicas, scaling.max_replicas) == (0, 2)
    out = capsys.readouterr().out
    assert "scaled to zero: the first request starts an ingress replica" in out
    assert "drained: 0 of 0 requests in flight finished, 0 aborted (on 0 ingress replicas)" in out
