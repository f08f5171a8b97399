"""Runtime LoRA loading at the front end (``frontend/lora_registry.py``, ``lora_contents.py``), without Ray or
torch: the load and unload routes are 404 with how to turn them on unless the server allows them; allowed, a
client may load only folders under ``lora_allowed_dirs`` (symlinks resolved), and a path outside them, missing, or
not a LoRA adapter all get one 400 that names no path (the reason goes to the log), while an adapter that does
not fit the model gets its reason (without the folder); every tensor's dtype and values are checked; the bytes
checked are kept (by digest, bounded), whatever happens to the files after."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from test_lora_serving import INFO, write_adapter

from cbserve.frontend.lora_contents import AdapterContents
from cbserve.frontend.lora_registry import (
    NOT_LOADABLE,
    RUNTIME_OFF,
    AdapterLimits,
    LoadLoRAAdapterRequest,
    LoRARegistry,
    UnloadLoRAAdapterRequest,
)
from cbserve.frontend.protocol import APIError
from cbserve.worker.lora.files import AdapterContent, read_content


def _registry(*allowed: Path, keep_unloaded: int = 16) -> LoRARegistry:
    dirs = tuple(str(d) for d in allowed) if allowed else None
    return LoRARegistry("base", AdapterLimits(INFO, max_lora_rank=16, allowed_dirs=dirs), keep_unloaded)


def _load(registry: LoRARegistry, path: str | Path, name: str = "x") -> APIError | str:
    try:
        return registry.load(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path)))
    except APIError as e:
        return e


def test_the_routes_are_off_unless_runtime_loading_is_allowed(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a")
    registry = _registry()  # LoRA on, runtime loading off (the default)
    for error in (_load(registry, adapter), _unload(registry, "a")):
        assert isinstance(error, APIError) and error.status == 404 and error.message == RUNTIME_OFF
    assert "--allow-runtime-lora-updating" in RUNTIME_OFF and "--lora-allowed-dirs" in RUNTIME_OFF
    assert registry.add("a", str(adapter)).lora_name == "a"  # the operator's lora_modules still load
    allowed = _registry(tmp_path)
    assert _load(allowed, adapter) == "Success: LoRA adapter 'x' added successfully."
    assert allowed.unload(UnloadLoRAAdapterRequest(lora_name="x")) == "Success: LoRA adapter 'x' removed successfully."


def _unload(registry: LoRARegistry, name: str) -> APIError | str:
    try:
        return registry.unload(UnloadLoRAAdapterRequest(lora_name=name))
    except APIError as e:
        return e


def test_outside_missing_and_not_an_adapter_are_one_400_that_names_no_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    write_adapter(outside / "real")  # a real adapter, but not under the allowed folder
    (allowed / "empty").mkdir()
    (allowed / "file").write_text("x")
    (allowed / "link").symlink_to(outside / "real")  # a link inside that leads outside
    files = write_adapter(allowed / "files")
    os.symlink(outside / "real" / "adapter_model.safetensors", files / "leak.safetensors")
    (files / "adapter_model.safetensors").unlink()
    (files / "leak.safetensors").rename(files / "adapter_model.safetensors")  # a file inside that leads outside
    prefix = write_adapter(tmp_path / "allowed-not")  # a sibling whose name starts like the allowed folder's
    not_lora = allowed / "prefix"
    not_lora.mkdir()
    (not_lora / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    registry = _registry(allowed)
    paths = [outside / "real", allowed / "missing", allowed / "empty", allowed / "file", allowed / "link",
             allowed / "files", prefix, not_lora, allowed / ".." / "outside" / "real", "", "rel", "/\0"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="cbserve.frontend.lora_registry"):
        answers = [_load(registry, p) for p in paths]
    assert all(isinstance(a, APIError) for a in answers), answers
    assert {(a.status, a.message, a.param) for a in answers} == {(400, NOT_LOADABLE, "lora_path")}  # type: ignore
    assert str(tmp_path) not in NOT_LOADABLE and registry.adapters() == [] and len(registry.contents) == 0
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == len(paths) and "not under lora_allowed_dirs" in logged[0] and str(outside) in logged[0]
    assert "no adapter_config.json" in logged[2] and "outside lora_allowed_dirs" in logged[5], logged


def test_a_link_within_the_allowed_folders_and_an_allowed_folder_given_through_a_link_load(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    write_adapter(real / "a")
    (real / "alias").symlink_to(real / "a")
    (tmp_path / "via").symlink_to(real)
    registry = _registry(tmp_path / "via")  # the allowed folder itself named through a link
    assert _load(registry, real / "alias", "one") == "Success: LoRA adapter 'one' added successfully."
    assert _load(registry, tmp_path / "via" / "a", "two") == "Success: LoRA adapter 'two' added successfully."
    assert [a.lora_path for a in registry.adapters()] == [str(real / "a")] * 2  # resolved


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"rank": 32}, "rank 32 is over max_lora_rank 16"),
        ({"hidden": 128}, "an adapter of another base model?"),
        ({"value": float("inf")}, "not finite (inf or NaN)"),
        ({"value": float("nan"), "dtype": "BF16"}, "not finite (inf or NaN)"),
        ({"value": float("inf"), "dtype": "F16"}, "not finite (inf or NaN)"),
        ({"dtype": "F64"}, "is F64: an adapter's weights are float16, bfloat16 or float32"),
        ({"layers": 3}, "layer 2 is past the model's 2"),
        ({"projections": ("q_proj", "qkv_proj")}, "target modules ['qkv_proj'] are not projections"),
    ],
)
def test_an_adapter_that_does_not_fit_gets_its_reason_without_its_folder(
    tmp_path: Path, kwargs: dict[str, Any], words: str
) -> None:
    folder = write_adapter(tmp_path / "bad", **kwargs)
    error = _load(_registry(tmp_path), folder)
    assert isinstance(error, APIError) and (error.status, error.param) == (400, "lora_path")
    assert words in error.message and str(tmp_path) not in error.message, error.message


@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_float16_bfloat16_and_float32_adapters_load(tmp_path: Path, dtype: str) -> None:
    assert _load(_registry(tmp_path), write_adapter(tmp_path / "a", dtype=dtype, value=0.5)) == (
        "Success: LoRA adapter 'x' added successfully.")


def _safetensors(header: dict[str, Any], data: bytes) -> bytes:
    import json

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    ("offsets", "extra", "words"),
    [
        ([[0, 2048], [2048, 4096]], b"", ""),  # the well-formed file the others break
        ([[0, 2048], [2052, 4100]], b"", "a hole or an overlap"),
        ([[0, 2048], [2044, 4092]], b"", "a hole or an overlap"),
        ([[0, 2048], [2048, 4096]], b"\0" * 4, "the file holds 4100"),
        ([[0, 2000], [2000, 4048]], b"", "has 2000 bytes"),
    ],
)
def test_the_tensors_must_fill_the_file_exactly(tmp_path: Path, offsets: list[list[int]], extra: bytes,
                                                 words: str) -> None:
    folder = write_adapter(tmp_path / "a", projections=("q_proj",), layers=1)  # A [8, 64] and B [64, 8], F32
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    header = {key.format("A"): {"dtype": "F32", "shape": [8, 64], "data_offsets": offsets[0]},
              key.format("B"): {"dtype": "F32", "shape": [64, 8], "data_offsets": offsets[1]}}  # fmt: skip
    size = max(end for _, end in offsets)
    (folder / "adapter_model.safetensors").write_bytes(_safetensors(header, bytes(size) + extra))
    answer = _load(_registry(tmp_path), folder)
    if not words:
        assert answer == "Success: LoRA adapter 'x' added successfully."
    else:
        assert isinstance(answer, APIError) and answer.status == 400 and words in answer.message, answer


def test_the_bytes_checked_are_kept_whatever_the_files_do_after(tmp_path: Path) -> None:
    folder = write_adapter(tmp_path / "a", value=0.25)
    registry = _registry(tmp_path)
    _load(registry, folder)
    lora = registry.resolve("x")
    assert lora is not None and lora.digest is not None
    before = read_content(folder)
    (folder / "adapter_model.safetensors").write_bytes(b"changed")
    kept = registry.contents.get(lora.digest)
    assert kept == before and kept.digest == lora.digest  # the checked bytes, not the changed file
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    assert registry.contents.get(lora.digest) == before


def _content(i: int) -> AdapterContent:
    return AdapterContent.of(b'{"peft_type": "LORA"}', bytes([i]))


def test_contents_keep_the_served_ones_and_the_last_few_unloaded() -> None:
    contents = AdapterContents(keep_unloaded=2)
    a, b, c, d = (_content(i) for i in range(4))
    for x in (a, a, b, c, d):  # a serves two names
        contents.add(x)
    contents.release(a.digest)
    assert a.digest in contents  # its other name still serves it
    for x in (a, b, c):
        contents.release(x.digest)
    assert a.digest not in contents and b.digest in contents and c.digest in contents  # the last 2 unloaded kept
    contents.add(b)  # loaded again: served, no longer among the unloaded
    contents.release(d.digest)
    assert len(contents) == 3 and all(x.digest in contents for x in (b, c, d))
    contents.release(b.digest)
    assert len(contents) == 2 and c.digest not in contents  # the oldest unloaded went
