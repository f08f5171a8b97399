"""CBServeConfig from YAML, from Serve args and from `cbserve serve` flags; the start-up checks against the
model (`cbserve serve` and build_app stop with one message); every field reaches what it configures. No Ray
cluster is started."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import torch

from cbserve.cluster.cli import serve as serve_cli
from cbserve.cluster.cli.serve import add_arguments, config_from_args
from cbserve.config import CBServeConfig, ConfigError, check_kv_capacity, servable_config
from cbserve.scheduler.config import SpeculativeConfig
from cbserve.worker.loading.model_info import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_local_yaml_serves_the_bundled_model_on_the_auto_device() -> None:
    config = CBServeConfig.from_yaml(ROOT / "deploy" / "serve-local.yaml")
    assert config.model is None and config.model_name == "SmolLM2-135M-Instruct"
    assert config.device == "auto" and config.resolved_device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert config.port == 8000 and config.tensor_parallel_size == 1


def test_serve_config_yaml_takes_the_first_apps_args() -> None:
    config = CBServeConfig.from_yaml(ROOT / "deploy" / "serve.yaml")
    assert config.tensor_parallel_size == 2 and config.num_replicas == 2 and config.device == "cuda"


def test_flags_override_the_file() -> None:
    config = config_from_args(_parse(["--config", str(ROOT / "deploy" / "serve-local.yaml"), "--port", "9123",
                                      "--num-replicas", "3"]))
    assert config.port == 9123 and config.num_replicas == 3 and config.max_num_seqs == 64


def test_no_arguments_give_the_defaults() -> None:
    config = config_from_args(_parse([]))
    assert config.model is None and config.port == 8000 and config.num_replicas >= 1


def test_serve_run_string_args_are_coerced() -> None:
    config = CBServeConfig.from_args({"num-replicas": "2", "api_key": "null", "max_model_len": "512"})
    assert config.num_replicas == 2 and config.api_key is None and config.max_model_len == 512


@pytest.mark.parametrize(
    "bad", [{"no_such_field": 1}, {"tensor_parallel_size": 0}, {"route_prefix": "v1"}, {"block_size": -16},
            {"cpu_ops": "mkl"}]
)
def test_bad_values_are_rejected(bad: dict) -> None:
    with pytest.raises((pydantic.ValidationError, ValueError)):
        CBServeConfig.from_args(bad)


def test_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        CBServeConfig.from_yaml(path)


# ---- a configuration that can never serve stops at start-up (no Ray, no torch) ----------------------------
SMOLLM2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "num_hidden_layers": 30, "max_position_embeddings": 8192, "intermediate_size": 1536}  # fmt: skip


def _hf_folder(tmp_path: Path, **changes: object) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    cfg = {k: v for k, v in {**SMOLLM2, **changes}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _serve(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = serve_cli.main(_parse(["--device", "cpu"] + argv + ["--ready-timeout", "1"]))  # argv's own --device wins
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel-size", "2"], "num_attention_heads (9) is not divisible by the tensor-parallel size (2)"),
        (["--tensor-parallel-size", "9"], "num_key_value_heads (3) is not divisible by the tensor-parallel size (9)"),
        (["--max-model-len", "9000"], "max_model_len (9000) is longer than the model's max_position_embeddings (8192)"),
        (["--device", "cpu", "--kv-cache-memory-bytes", str(16 * 1024**2)],
         "max_model_len (2048) tokens needs 128"),  # 16 MiB hold 22 blocks of the bundled model
        (["--num-kv-blocks", "24", "--max-model-len", "1024"], "the KV cache (num_kv_blocks=24) holds 24 blocks"),
        (["--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
        (["--tensor-parallel-size", "0"], "tensor_parallel_size: Input should be greater than or equal to 1"),
        (["--dtype", "int8"], "dtype: Input should be"),
    ],
)
def test_cbserve_serve_refuses_a_config_that_can_never_serve(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _serve(argv, capsys)
    assert rc != 0
    assert err.count("\n") == 1 and err.startswith("cbserve: error: ") and message in err, err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()  # stopped before Ray


@pytest.mark.parametrize(
    ("changes", "raw", "message"),
    [
        ({"num_attention_heads": 8, "num_key_value_heads": 2}, None,
         "num_key_value_heads (2) is not divisible by the tensor-parallel size (4)"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1530}, None,
         "intermediate_size (1530) is not divisible by the tensor-parallel size (4)"),
        ({"num_attention_heads": 8, "num_key_value_heads": 4, "model_type": "qwen3_moe", "moe_intermediate_size": 90},
         None, "moe_intermediate_size (90) is not divisible by the tensor-parallel size (4)"),
        ({"model_type": "gpt2"}, None, "model_type 'gpt2' is not supported"),
        ({"num_hidden_layers": None}, None, "the model config lacks num_hidden_layers"),
        ({}, "{not json", "is not a readable JSON file"),
        ({"num_attention_heads": "many"}, None, "malformed value"),
    ],
)
def test_cbserve_serve_refuses_a_model_that_cannot_load(
    tmp_path: Path, changes: dict, raw: str | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _hf_folder(tmp_path, **changes)
    if raw is not None:
        (Path(folder) / "config.json").write_text(raw)
    rc, err = _serve(["--model", folder, "--tensor-parallel-size", "4"], capsys)
    assert rc != 0 and err.startswith("cbserve: error: ") and message in err, err


def test_a_file_that_is_no_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="is not a GGUF v2/v3 file"):
        servable_config(CBServeConfig(model=str(bad), device="cpu"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(default_model_path()).read_bytes()[:4096])
    with pytest.raises(ConfigError, match="truncated or malformed GGUF header"):
        servable_config(CBServeConfig(model=str(truncated), device="cpu"))


def test_the_cli_stops_in_a_subprocess_before_ray_starts() -> None:
    cli = Path(sys.executable).with_name("cbserve")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [str(cli), "serve", "--ray-address", "local", "--device", "cpu", "--tensor-parallel-size", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "cbserve: error: num_attention_heads (9) is not divisible by the tensor-parallel size (2)"
    )


def test_an_unset_max_model_len_is_capped_by_the_model_an_explicit_one_is_not(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path, max_position_embeddings=512)
    assert servable_config(CBServeConfig(model=folder, device="cpu")).max_model_len == 512
    assert servable_config(CBServeConfig(model=folder, max_model_len=256, device="cpu")).max_model_len == 256
    with pytest.raises(ConfigError, match=r"max_model_len \(1024\) is longer"):
        servable_config(CBServeConfig(model=folder, max_model_len=1024, device="cpu"))
    resolved = servable_config(CBServeConfig(model=folder, device="cpu"))
    assert CBServeConfig.model_validate(resolved.model_dump()).max_model_len == 512  # what the actors get


def test_kv_budget_is_checked_on_cpu_and_where_the_blocks_are_known(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path)  # 30 layers x 3 KV heads x 64 x 2 x 4 bytes x 16 tokens = 737280 B/block
    fits = CBServeConfig(model=folder, max_model_len=353, kv_cache_memory_bytes=22 * 737280, device="cpu")  # 22 blocks
    servable_config(fits, "cpu")
    with pytest.raises(ConfigError, match="needs 23"):
        servable_config(fits.model_copy(update={"max_model_len": 354}), "cpu")
    servable_config(fits.model_copy(update={"max_model_len": 354}), "cuda")  # known after loading on CUDA
    servable_config(fits.model_copy(update={"max_model_len": 354, "tensor_parallel_size": 3}), "cpu")  # 1/3
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.9"):
        check_kv_capacity(fits, 21, "cuda")  # what the engine replica checks once the workers sized the cache
    check_kv_capacity(fits, 22, "cuda")


def test_build_app_refuses_a_config_that_can_never_serve() -> None:
    from cbserve.cluster.app import build_app

    with pytest.raises(ConfigError, match=r"num_attention_heads \(9\) is not divisible"):
        build_app({"tensor_parallel_size": 2, "device": "cpu"})


# ---- every field reaches what it configures ---------------------------------------------------------------
def test_the_worker_config_is_derived_from_every_matching_field() -> None:
    from cbserve.worker.config import ModelConfig

    values = {"model": "/m", "dtype": "bfloat16", "device": "cuda", "max_model_len": 77, "seed": 5,
              "kv_cache_memory_bytes": 12345, "gpu_memory_utilization": 0.5, "attention_backend": "torch",
              "enforce_eager": True, "cudagraph_mode": "full_and_piecewise", "cpu_ops": "native", "cpu_isa": "scalar",
              "cpu_compact_weights": False, "tensor_parallel_size": 3, "runner": "pooling", "enable_lora": False,
              "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4, "block_size": 8, "max_num_batched_tokens": 64,
              "max_num_seqs": 3, "quantization": "fp8",
              "kv_cache_dtype": "fp8"}  # fmt: skip  (enable_lora: test_lora_config.py)
    mc = CBServeConfig(**values).worker_model_config(rank=2)
    # the draft model's fields come from speculative_config (see the speculative_config test below)
    # the KV tiers' sizes are GiB in the user's config and bytes in the worker's (see the next test)
    tiers = {"kv_offloading_bytes", "kv_offloading_dtype", "kv_disk_path", "kv_disk_bytes"}
    handoff = {"kv_role", "kv_shm_path", "kv_transfer_timeout_s", "kv_pull_wait_s", "kv_transport"}  # pd_config.py
    apart = {"cpu_decode_activations", "cpu_prefill_activations"}  # "int16": not with cuda and fp8 (test_config_cpu.py)
    derived = {"rank", "draft_model", "num_speculative_tokens"} | tiers | handoff | apart
    assert {f.name for f in dataclasses.fields(ModelConfig)} == set(values) | derived
    assert {k: getattr(mc, k) for k in values} == values and mc.rank == 2


def test_the_kv_tiers_reach_the_worker_in_bytes() -> None:
    mc = CBServeConfig(device="cpu", kv_offloading_size=1.5, kv_disk_path="/d", kv_disk_size=0.25).worker_model_config()
    assert (mc.kv_offloading_bytes, mc.kv_disk_path, mc.kv_disk_bytes) == (3 * 2**29, "/d", 2**28)
    assert CBServeConfig(device="cpu").worker_model_config().kv_offloading_bytes == 0
    compressed = CBServeConfig(device="cpu", kv_offloading_size=1, kv_offloading_dtype="bfloat16")
    assert compressed.worker_model_config().kv_offloading_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_offloading_dtype applies to the KV tiers"):
        CBServeConfig(device="cpu", kv_offloading_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_offloading_backend"):
        CBServeConfig(device="cpu", kv_offloading_backend="lmcache")


def test_the_engine_config_is_derived_from_the_engine_fields() -> None:
    config = CBServeConfig(device="cpu", block_size=8, max_num_batched_tokens=64, max_num_seqs=3, max_model_len=99,
                           policy="static", enable_prefix_caching=False, max_waiting=7, ordering="priority")
    ec = config.engine_config(num_blocks=42)
    assert (ec.cache.block_size, ec.cache.num_blocks, ec.cache.enable_prefix_caching) == (8, 42, False)
    sc = ec.scheduler
    assert (sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len, sc.policy, sc.max_waiting, sc.ordering) == (
        64, 3, 99, "static", 7, "priority"
    )
    assert sc.async_scheduling is True  # the served engine overlaps by default
    assert CBServeConfig(async_scheduling=False, device="cpu").engine_config(4).scheduler.async_scheduling is False
    knobs = CBServeConfig(enable_chunked_prefill=False, policy="dynamic", dynamic_batch_window_s=0.2,
                          dynamic_batch_size=5, device="cpu").engine_config(num_blocks=4).scheduler
    assert (knobs.enable_chunked_prefill, knobs.dynamic_batch_window_s, knobs.dynamic_batch_size) == (False, 0.2, 5)


def test_runner_pooling_reaches_the_engine_without_prefix_caching(tmp_path: Path) -> None:
    ec = CBServeConfig(runner="pooling", device="cpu").engine_config(num_blocks=4)
    assert (ec.runner, ec.cache.enable_prefix_caching) == ("pooling", False)
    assert CBServeConfig(device="cpu").engine_config(num_blocks=4).runner == "generate"
    with pytest.raises(ValueError, match="speculative_config"):
        CBServeConfig(runner="pooling", speculative_config=dict(method="ngram", num_speculative_tokens=2), device="cpu")
    folder = Path(_hf_folder(tmp_path))
    (folder / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "x.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    servable_config(CBServeConfig(model=str(folder), device="cpu"))  # generating: the files do not matter
    with pytest.raises(ConfigError, match="runner 'pooling'.*weightedmean"):
        servable_config(CBServeConfig(model=str(folder), runner="pooling", device="cpu"))


@pytest.mark.parametrize("bad", [{"request_timeout_s": 0}, {"request_timeout_s": -1}, {"attention_backend": "x"}])
def test_more_bad_values_are_rejected(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        CBServeConfig(**bad)


def test_cbserve_serve_deploys_with_host_port_route_prefix_and_app_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cbserve serve`'s Ray and Serve calls, faked: the HTTP and app fields reach them."""
    import ray
    from ray import serve

    calls: dict[str, object] = {}
    monkeypatch.setattr(serve_cli, "init_ray", lambda address, dashboard: calls.update(ray_address=address) or False)
    monkeypatch.setattr(serve, "start", lambda http_options: calls.update(http=http_options))
    monkeypatch.setattr(serve, "run", lambda app, **kw: calls.update(run=kw, app=app))
    monkeypatch.setattr(serve, "delete", lambda name: calls.update(deleted=name))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.update(shutdown=True))
    monkeypatch.setattr(serve_cli, "wait_ready", lambda base, timeout, key: calls.update(base=base) or (True, None))
    per_replica = [{"in_flight": 2, "aborted": 0}, {"in_flight": 1, "aborted": 1}]
    drained = argparse.Namespace(results=lambda timeout_s: per_replica)
    handle = argparse.Namespace(broadcast=lambda method: drained if method == "drain" else None)  # every replica
    monkeypatch.setattr(serve, "get_app_handle", lambda name: calls.update(drained=name) or handle)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(serve_cli, "time", argparse.Namespace(sleep=interrupted))
    argv = ["--device", "cpu", "--host", "127.0.0.2", "--port", "8123", "--route-prefix", "/llm", "--app-name",
            "my-app", "--ray-address", "auto", "--max-model-len", "256"]  # fmt: skip
    assert serve_cli.main(_parse(argv)) == 0
    assert calls["ray_address"] == "auto" and calls["http"] == {"host": "127.0.0.2", "port": 8123}
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in os.environ  # a joined cluster: the proxy serves, no leftovers
    assert calls["run"] == {"name": "my-app", "route_prefix": "/llm", "blocking": False}
    assert calls["base"] == "http://127.0.0.2:8123/llm" and calls["deleted"] == "my-app" and calls["shutdown"]
    deployed = CBServeConfig.model_validate(calls["app"]._bound_deployment.init_args[0])  # type: ignore[attr-defined]
    assert deployed.max_model_len == 256 and deployed.app_name == "my-app"
    out = capsys.readouterr().out
    assert "http://127.0.0.2:8123/llm/v1" in out
    assert calls["drained"] == "my-app"
    assert "drained: 2 of 3 requests in flight finished, 1 aborted (on 2 ingress replicas)" in out


def test_the_hop_and_the_worker_threads_follow_the_device() -> None:
    cpu = CBServeConfig(device="cpu", tensor_parallel_size=2)
    assert cpu.use_compiled_graph == "auto" and cpu.compiled_graph is False  # its reader would spin a core
    assert CBServeConfig(device="cuda", tensor_parallel_size=2).compiled_graph is True
    assert CBServeConfig(device="cpu", tensor_parallel_size=2, use_compiled_graph=True).compiled_graph is True
    assert CBServeConfig(device="cuda", tensor_parallel_size=2, use_compiled_graph=False).compiled_graph is False
    assert CBServeConfig(device="cuda").compiled_graph is False  # one rank: it runs in the engine actor, no hop
    with pytest.raises(ValueError, match="use_compiled_graph applies to tensor_parallel_size > 1"):
        CBServeConfig(device="cpu", use_compiled_graph=True)
    cpu = CBServeConfig(device="cpu")
    assert cpu.worker_threads(8) == 8  # not the one thread Ray's num_cpus=1 would leave
    assert CBServeConfig(device="cpu", tensor_parallel_size=2).worker_threads(8) == 4
    assert CBServeConfig(device="cpu", tensor_parallel_size=4).worker_threads(2) == 1
    assert CBServeConfig(device="cpu", worker_torch_threads=3).worker_threads(8) == 3
    assert CBServeConfig(device="cuda").worker_threads(8) is None


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def test_speculative_config_reaches_the_engine_and_turns_async_scheduling_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = CBServeConfig(speculative_config=NGRAM, device="cpu")
    assert cfg.async_scheduling  # the default, kept as the user set it...
    with caplog.at_level("INFO", logger="cbserve.config.serve_config"):
        engine = cfg.engine_config(64)
    assert not engine.scheduler.async_scheduling  # ...but the engine runs without it
    assert engine.speculative == SpeculativeConfig("ngram", 4, 2, 5)
    lines = [r.getMessage() for r in caplog.records if "async scheduling" in r.getMessage()]
    assert len(lines) == 1 and "speculative_config" in lines[0]
    plain = CBServeConfig(device="cpu").engine_config(64)
    assert plain.scheduler.async_scheduling and plain.speculative is None


def test_speculative_config_from_yaml_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 3\n")
    assert CBServeConfig.from_yaml(path).speculative == SpeculativeConfig("ngram", 3)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert config_from_args(args).speculative == SpeculativeConfig("ngram", 4, 2, 5)
    draft = CBServeConfig(speculative_config={"method": "draft_model", "model": "/m", "num_speculative_tokens": 3},
                          device="cpu")
    worker = draft.worker_model_config()
    assert (worker.draft_model, worker.num_speculative_tokens) == ("/m", 3)  # the worker loads the draft
    assert CBServeConfig(speculative_config=NGRAM, device="cpu").worker_model_config().draft_model is None
    local = CBServeConfig.from_yaml(Path(__file__).parents[2] / "deploy" / "serve-local.yaml")
    assert local.speculative_config is None


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
        ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "unknown keys"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 1},
         "prompt_lookup_max"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_speculative_configs_are_refused(bad: object, match: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        CBServeConfig(speculative_config=bad, device="cpu")
