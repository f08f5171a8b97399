"""``LLM(model, **fields)`` takes ``CBServeConfig``'s fields with the same defaults (config/offline.py): every field is
either accepted offline or refused by name as served-only, unknown names are refused, and the engine and worker
configurations of an ``LLM`` are the ones the served path derives from the same config."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest

from cbserve import LLM, SamplingParams
from cbserve.config import CBServeConfig, ConfigError
from cbserve.config.offline import SERVED_ONLY, offline_config

FIELDS = CBServeConfig.model_fields
OFFLINE = sorted(set(FIELDS) - set(SERVED_ONLY) - {"model"})


def test_every_field_is_taken_offline_with_its_default_or_refused_as_served_only() -> None:
    assert set(SERVED_ONLY) <= set(FIELDS), f"stale served-only names: {sorted(set(SERVED_ONLY) - set(FIELDS))}"
    params = inspect.signature(LLM.__init__).parameters
    assert params["model"].default is None and params["progress"].kind is inspect.Parameter.KEYWORD_ONLY
    assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD  # the fields
    assert offline_config(None, {}) == CBServeConfig()  # nothing given: CBServeConfig's defaults
    for name in OFFLINE:
        default = FIELDS[name].get_default(call_default_factory=True)
        config = offline_config(None, {name: default})
        assert getattr(config, name) == default and config == CBServeConfig(), name
    assert {"max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes", "async_scheduling"} <= set(OFFLINE)
    assert CBServeConfig().max_num_batched_tokens == 2048  # the served default, offline too


@pytest.mark.parametrize("name", sorted(SERVED_ONLY))
def test_served_only_fields_are_refused_by_name(name: str) -> None:
    value = FIELDS[name].get_default(call_default_factory=True)
    with pytest.raises(TypeError, match=rf"served-only fields \({name}: "):
        offline_config(None, {name: value if value is not None else 1})


def test_llm_refuses_served_only_and_unknown_names_before_loading_anything() -> None:
    with pytest.raises(TypeError, match=r"served-only fields \(api_key: .*; port: .*\)"):
        LLM(port=8001, api_key="k", device="cpu")
    with pytest.raises(TypeError, match="unknown LLM arguments: max_num_batched_token, rank"):
        LLM(rank=0, max_num_batched_token=64, device="cpu")
    with pytest.raises(TypeError, match="model once"):
        offline_config(None, {"model": "x"})
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= block_size"):
        LLM(block_size=32, max_num_batched_tokens=16, device="cpu")  # CBServeConfig's own check
    with pytest.raises(ConfigError, match=r"max_model_len \(9000\) is longer than the model's"):
        LLM(max_model_len=9000, device="cpu")  # the bundled SmolLM2 has 8192 positions: the served start-up check


def test_none_means_unset() -> None:
    """As with CLI flags: ``LLM(max_model_len=None)`` keeps the default (callers pass optional values through)."""
    assert offline_config(None, {"max_model_len": None, "max_num_seqs": None}) == CBServeConfig()


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    import torch

    torch.set_num_threads(1)
    llm = LLM(progress=False, max_model_len=256, num_kv_blocks=40, max_num_seqs=8, policy="prefill_first", device="cpu")
    yield llm
    llm.shutdown()


def test_the_engine_and_worker_configs_are_the_served_derivations(llm: LLM) -> None:
    config = CBServeConfig(max_model_len=256, num_kv_blocks=40, max_num_seqs=8, policy="prefill_first", device="cpu")
    assert llm.config == config
    assert llm.engine_config == config.engine_config(40)
    assert llm.model_config == config.worker_model_config()
    assert llm.engine_config.scheduler.max_num_batched_tokens == 2048
    assert llm.engine_config.scheduler.async_scheduling  # the served default: two steps in flight
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_a_kv_cache_that_cannot_hold_one_request_is_refused_as_served() -> None:
    with pytest.raises(ConfigError, match=r"num_kv_blocks=8.* holds 8 blocks .* needs 16"):
        LLM(progress=False, max_model_len=256, num_kv_blocks=8, device="cpu")


def test_the_configuration_is_read_and_checked_without_ray() -> None:
    """cbserve.config is what both sides import: a served-only key (autoscaling, checked by a copy of Serve's
    rules) and the model checks run without importing ray."""
    import subprocess
    import sys

    code = ("import sys; from cbserve.config import CBServeConfig, servable_config; "
            "servable_config(CBServeConfig(device='cpu', autoscaling='min=0,max=2', routing='affinity'), 'cpu'); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
