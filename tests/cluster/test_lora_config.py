"""The LoRA keys of CBServeConfig (vLLM's names and flags): ``lora_modules`` in every form users write it
(YAML mapping, ``--lora-modules name=path ...``, vLLM's JSON items, Serve args), the checks between the keys,
the start-up check of every adapter against the model, and what reaches the engine and the workers. No Ray,
no torch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pydantic
import pytest

from cbserve.cluster.cli import serve as serve_cli
from cbserve.cluster.cli.serve import add_arguments, config_from_args
from cbserve.config import CBServeConfig, ConfigError, servable_config
from cbserve.config.lora_config import parse_lora_modules

SMOLLM2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "num_hidden_layers": 30, "max_position_embeddings": 8192, "intermediate_size": 1536}  # fmt: skip


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_flags_take_vllms_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["--enable-lora", "--lora-modules", "sql=adapters/sql", '{"name": "chat", "path": "/a/chat"}',
            "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8"]  # fmt: skip
    config = config_from_args(_parse(argv))
    assert config.enable_lora is True and config.lora_modules == {"sql": str(tmp_path / "adapters/sql"),
                                                                  "chat": "/a/chat"}  # fmt: skip
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (4, 64, 8)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    runtime = config_from_args(_parse(["--enable-lora", "--allow-runtime-lora-updating", "--lora-allowed-dirs",
                                       *map(str, dirs)]))  # fmt: skip
    assert runtime.allow_runtime_lora_updating is True and runtime.lora_allowed_dirs == [str(d) for d in dirs]
    assert config_from_args(_parse(["--enable-lora", "false"])).enable_lora is False  # a value still works
    assert config_from_args(_parse(["--enforce-eager"])).enforce_eager is True  # every boolean flag alike
    piecewise = config_from_args(_parse(["--cudagraph-mode", "full_and_piecewise"]))
    assert piecewise.worker_model_config().cudagraph_mode == "full_and_piecewise"
    with pytest.raises(pydantic.ValidationError, match="cudagraph_mode"):
        config_from_args(_parse(["--cudagraph-mode", "piecewise"]))
    assert config_from_args(_parse([])).enable_lora is False


def test_the_keys_reach_the_engine_and_the_workers() -> None:
    on = CBServeConfig(enable_lora=True, max_loras=3, max_lora_rank=32, max_cpu_loras=5, device="cpu")
    assert on.engine_config(num_blocks=4).scheduler.max_loras == 3
    worker = on.worker_model_config()
    assert (worker.enable_lora, worker.max_loras, worker.max_lora_rank, worker.max_cpu_loras) == (True, 3, 32, 5)
    off = CBServeConfig(max_loras=3, device="cpu")
    assert off.engine_config(num_blocks=4).scheduler.max_loras == 0  # LoRA off: requests naming one are refused
    assert off.worker_model_config().enable_lora is False


def test_yaml_and_serve_args(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("enable_lora: true\nlora_modules:\n  sql: /a/sql\n  chat: /a/chat\n")
    assert CBServeConfig.from_yaml(path).lora_modules == {"sql": "/a/sql", "chat": "/a/chat"}
    path.write_text("enable_lora: true\nlora_modules:\n  - {name: sql, path: /a/sql}\n")
    assert CBServeConfig.from_yaml(path).lora_modules == {"sql": "/a/sql"}
    args = CBServeConfig.from_args({"enable-lora": "true", "lora_modules": "sql=/a/sql chat=/a/chat"})
    assert args.lora_modules == {"sql": "/a/sql", "chat": "/a/chat"}  # `serve run ... lora_modules=...`
    assert CBServeConfig.from_args({"enable_lora": "true", "lora_modules": '{"sql": "/a/sql"}'}).lora_modules == {
        "sql": "/a/sql"}
    dumped = args.model_dump()  # what the ingress replicas get
    assert CBServeConfig.model_validate(dumped).lora_modules == args.lora_modules
    assert parse_lora_modules("") == {} and parse_lora_modules(None) is None


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"lora_modules": {"sql": "/a"}}, "lora_modules needs enable_lora"),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras (2) must be >= max_loras (4)"),
        ({"enable_lora": True, "runner": "pooling"}, "enable_lora does not combine with runner 'pooling'"),
        ({"enable_lora": True, "speculative_config": {"method": "draft_model", "model": "/m",
                                                      "num_speculative_tokens": 2}}, "a draft model"),
        ({"enable_lora": True, "lora_modules": ["sql=/a", "sql=/b"]}, "'sql' is given twice"),
        ({"enable_lora": True, "lora_modules": ["sql"]}, "expected name=path"),
        ({"enable_lora": True, "lora_modules": ["=/a"]}, "non-empty string"),
        ({"enable_lora": True, "lora_modules": ['{"name": "a", "path": "/a", "base_model_name": "m"}']},
         "unknown keys ['base_model_name']"),
        ({"enable_lora": True, "lora_modules": "{broken"}, "not valid JSON"),
        ({"enable_lora": True, "lora_modules": {"SmolLM2-135M-Instruct": "/a"}}, "the served model's name"),
        ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank"),
        ({"enable_lora": True, "max_lora_rank": 513}, "max_lora_rank"),
        ({"allow_runtime_lora_updating": True, "lora_allowed_dirs": ["/a"]},
         "allow_runtime_lora_updating needs enable_lora"),
        ({"enable_lora": True, "allow_runtime_lora_updating": True},
         "allow_runtime_lora_updating needs lora_allowed_dirs"),
        ({"enable_lora": True, "allow_runtime_lora_updating": True, "lora_allowed_dirs": []},
         "allow_runtime_lora_updating needs lora_allowed_dirs"),
        ({"enable_lora": True, "lora_allowed_dirs": ["/a"]}, "lora_allowed_dirs needs allow_runtime_lora_updating"),
        ({"enable_lora": True, "allow_runtime_lora_updating": True, "lora_allowed_dirs": [""]},
         "lora_allowed_dirs: expected a list of folders"),
        ({"enable_lora": True, "allow_runtime_lora_updating": True, "lora_allowed_dirs": "[broken"}, "not valid JSON"),
    ],
)
def test_bad_lora_settings_name_the_key(values: dict, words: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        CBServeConfig(**values)
    assert words in serve_cli.error_message(info.value), serve_cli.error_message(info.value)


def test_every_adapter_is_checked_at_start_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    empty = tmp_path / "empty"
    empty.mkdir()
    config = CBServeConfig(model=str(model), enable_lora=True, lora_modules={"sql": str(empty)}, device="cpu")
    with pytest.raises(ConfigError, match=r"lora_modules: adapter 'sql' at .*empty: no adapter_config.json"):
        servable_config(config)
    servable_config(CBServeConfig(model=str(model), enable_lora=True, device="cpu"))  # no adapters: nothing to check
    rc = serve_cli.main(_parse(["--model", str(model), "--device", "cpu", "--enable-lora", "--lora-modules",
                                f"bad={tmp_path}/none", "--ready-timeout", "1"]))  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith(f"cbserve: error: lora_modules: adapter 'bad' at {tmp_path}/none: not a folder")


def test_runtime_loading_keys_in_their_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``allow_runtime_lora_updating`` and ``lora_allowed_dirs`` as flags (paths made absolute where read), YAML
    lists, Serve args (one string: a JSON list or paths apart by spaces)."""
    monkeypatch.chdir(tmp_path)
    argv = ["--enable-lora", "--allow-runtime-lora-updating", "--lora-allowed-dirs", "adapters"]
    config = config_from_args(_parse(argv))
    assert config.allow_runtime_lora_updating is True and config.lora_allowed_dirs == [str(tmp_path / "adapters")]
    on = {"enable_lora": "true", "allow_runtime_lora_updating": "true"}
    assert CBServeConfig.from_args({**on, "lora_allowed_dirs": "adapters /srv/more"}).lora_allowed_dirs == [
        str(tmp_path / "adapters"), "/srv/more"]
    args = CBServeConfig.from_args({**on, "lora_allowed_dirs": '["/a b", "/c"]'})
    assert args.lora_allowed_dirs == ["/a b", "/c"]
    assert CBServeConfig.model_validate(args.model_dump()).lora_allowed_dirs == ["/a b", "/c"]  # to the replicas
    path = tmp_path / "c.yaml"
    path.write_text("enable_lora: true\nallow_runtime_lora_updating: true\nlora_allowed_dirs: [/x, ~/y]\n")
    assert CBServeConfig.from_yaml(path).lora_allowed_dirs == ["/x", str(Path.home() / "y")]
    default = CBServeConfig(device="cpu")
    assert default.allow_runtime_lora_updating is False and default.lora_allowed_dirs is None


def test_the_allowed_folders_must_exist_at_start_up(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    on = {"model": str(model), "enable_lora": True, "allow_runtime_lora_updating": True, "device": "cpu"}
    servable_config(CBServeConfig(**on, lora_allowed_dirs=[str(tmp_path)]))
    with pytest.raises(ConfigError, match=f"lora_allowed_dirs: {tmp_path}/nope is not a folder"):
        servable_config(CBServeConfig(**on, lora_allowed_dirs=[str(tmp_path), str(tmp_path / "nope")]))


def test_the_ingress_registry_takes_the_runtime_keys(tmp_path: Path) -> None:
    """``_lora_registry``: the load and unload routes 404 unless runtime loading is on; on, the allowed folders."""
    from cbserve.cluster.ingress.deployment import _lora_registry
    from cbserve.frontend.protocol import APIError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMOLLM2))
    lora = {"model": str(model), "enable_lora": True, "device": "cpu"}
    for config in (CBServeConfig(model=str(model), device="cpu"), CBServeConfig(**lora)):
        with pytest.raises(APIError) as off:
            _lora_registry(config).check_runtime()
        assert off.value.status == 404 and "--allow-runtime-lora-updating" in off.value.message
    on = _lora_registry(CBServeConfig(**lora, allow_runtime_lora_updating=True, lora_allowed_dirs=[str(tmp_path)]))
    on.check_runtime()
    assert on.limits is not None and on.limits.allowed_dirs == (str(tmp_path),) and on.limits.max_lora_rank == 16
