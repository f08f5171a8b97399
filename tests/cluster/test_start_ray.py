"""How `cbserve serve` starts Ray (cluster/cli/serve.py): ``--ray-dashboard`` only where this command starts Ray
(a joined cluster keeps its own setting, and the flag says so instead of doing nothing), and direct ingress
where it starts Ray, with what Serve reads in the environment only while Ray starts."""

from __future__ import annotations

import argparse
import os

import pytest

from cbserve.cluster.cli import serve as serve_cli
from cbserve.cluster.cli.serve import add_arguments
from cbserve.cluster.ops.node_tuning import node_tuning


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("argv", "address", "starts", "want"), [
    ([], None, True, (None, False)),  # a Ray instance of its own: without Ray's dashboard
    (["--ray-dashboard"], None, True, (None, True)),
    (["--ray-dashboard", "--ray-address", "local"], "local", True, ("local", True)),
])  # fmt: skip
def test_ray_dashboard_reaches_the_ray_instance_cbserve_serve_starts(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], address: str | None, starts: bool, want: tuple
) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    seen: list[tuple] = []
    monkeypatch.setattr(serve_cli, "init_ray", lambda a, dashboard: seen.append((a, dashboard)) or starts)
    serve_cli.start_ray(_parse(argv), 8123, node_tuning("off"))
    assert seen == [want]


def test_ray_dashboard_on_a_joined_cluster_is_refused_or_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster given by address keeps its own dashboard: the flag is refused; one found running (no address)
    is joined and the log says the flag did not apply."""
    assert serve_cli.main(_parse(["--ray-dashboard", "--ray-address", "auto", "--device", "cpu"])) == 1
    assert "--ray-dashboard applies to the Ray instance `cbserve serve` starts" in capsys.readouterr().err
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(serve_cli, "init_ray", lambda a, dashboard: False)
    with caplog.at_level("WARNING", logger=serve_cli.__name__):
        assert serve_cli.start_ray(_parse(["--ray-dashboard"]), 8123, node_tuning("off")) == (False, False)
    assert "keeps its own dashboard setting" in caplog.text


@pytest.mark.parametrize(("address", "dashboard", "running", "want"), [
    ("local", True, False, [{"address": "local", "include_dashboard": True}]),
    ("local", False, False, [{"address": "local", "include_dashboard": False}]),
    (None, False, False, [{"address": "auto"}, {"include_dashboard": False}]),  # none running: start one
    (None, True, True, [{"address": "auto"}]),  # one running: joined as it is
    ("auto", True, True, [{"address": "auto"}]),
])  # fmt: skip
def test_init_ray_asks_for_the_dashboard_only_when_it_starts_ray(
    monkeypatch: pytest.MonkeyPatch, address: str | None, dashboard: bool, running: bool, want: list[dict]
) -> None:
    import ray

    calls: list[dict] = []

    def init(**kwargs: object) -> None:
        calls.append(kwargs)
        if kwargs.get("address") == "auto" and not running:
            raise ConnectionError("no cluster")

    monkeypatch.setattr(ray, "init", init)
    assert serve_cli.init_ray(address, dashboard) == (address == "local" or not running)
    assert calls == want


@pytest.mark.parametrize(
    ("flag", "address", "starts", "want_address", "want_direct"),
    [
        ("auto", None, True, None, True),  # no cluster running: this command starts Ray, the ingress serves HTTP
        ("auto", None, False, None, False),  # joined a running cluster: Serve's proxy serves
        ("true", None, True, "local", True),  # always a Ray instance of its own
        ("false", "local", True, "local", False),
    ],
)
def test_direct_ingress_follows_who_starts_ray(
    monkeypatch: pytest.MonkeyPatch, flag: str, address: str | None, starts: bool, want_address: str | None,
    want_direct: bool,
) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    seen: list[str | None] = []
    keys = serve_cli.direct_ingress_env(8123)
    at_start: dict[str, str | None] = {}

    def init(a: str | None, dashboard: bool) -> bool:
        seen.append(a)
        at_start.update({k: os.environ.get(k) for k in keys})  # what the Ray processes it starts inherit
        return starts

    monkeypatch.setattr(serve_cli, "init_ray", init)
    args = argparse.Namespace(direct_ingress=flag, ray_address=address, ray_dashboard=False)
    assert serve_cli.start_ray(args, 8123, node_tuning("off")) == (starts, want_direct) and seen == [want_address]
    if flag != "false":
        assert at_start["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        assert at_start["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8123"  # the one port: --port
        assert at_start["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8124"
    else:
        assert set(at_start.values()) == {None}
    assert {k: os.environ.get(k) for k in keys} == dict.fromkeys(keys)  # taken back once Ray started

