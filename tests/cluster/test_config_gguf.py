"""The GGUF side of the start-up checks: a GGUF file's header gives the model's numbers without torch, and its
architecture maps to a served model type or is refused with the reason (headers written with ``gguf``'s writer)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cbserve.config import CBServeConfig, ConfigError, servable_config
from cbserve.worker.loading.model_info import read_model_info


def test_the_gguf_header_gives_the_models_numbers_without_torch() -> None:
    info = read_model_info(None)  # the bundled SmolLM2-135M GGUF
    assert (info.model_type, info.num_attention_heads, info.num_key_value_heads) == ("llama", 9, 3)
    assert (info.head_dim, info.num_hidden_layers, info.max_position_embeddings) == (64, 30, 8192)
    assert info.intermediate_size == 1536
    code = "import sys; from cbserve.config import *; from cbserve.cluster.cli.serve import *; "
    code += "servable_config(CBServeConfig()); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _gguf_header(path: Path, arch: str, **keys: int) -> str:
    """A GGUF file with only a header: ``general.architecture`` and ``{arch}.<key>`` values."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return str(path)


def test_gguf_architectures_map_to_served_model_types_or_are_refused_with_the_reason(tmp_path: Path) -> None:
    moe = _gguf_header(tmp_path / "moe.gguf", "qwen3moe", attention__head_count=8, attention__head_count_kv=8,
                       embedding_length=64, block_count=2, expert_feed_forward_length=52)
    info = read_model_info(moe)
    assert (info.model_type, info.moe_intermediate_size) == ("qwen3_moe", 52)
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(52\) is not divisible .* \(8\)"):
        servable_config(CBServeConfig(model=moe, tensor_parallel_size=8, device="cpu"))
    gemma3 = _gguf_header(tmp_path / "g3.gguf", "gemma3", attention__head_count=4, embedding_length=64,
                          block_count=2)
    assert read_model_info(gemma3).model_type == "gemma3_text"  # the text backbone's model type
    for arch, reason in [("gemma", "Gemma 1"), ("qwen2moe", "architecture 'qwen2moe' is not supported")]:
        path = _gguf_header(tmp_path / f"{arch}.gguf", arch, attention__head_count=4, block_count=2)
        with pytest.raises(ConfigError, match=f"cannot load the model .*{reason}"):
            servable_config(CBServeConfig(model=path, device="cpu"))
    mixtral = _gguf_header(tmp_path / "mixtral.gguf", "llama", attention__head_count=4, block_count=2,
                           expert_count=8)
    with pytest.raises(ConfigError, match="Mixtral"):
        servable_config(CBServeConfig(model=mixtral, device="cpu"))
