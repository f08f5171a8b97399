"""LoRA adapters at the front end, without Ray or torch (``frontend/lora_registry.py``): a request's ``model``
naming an adapter reaches the engine with its ``LoRARequest`` (chat, completions, the Responses API), answers
carry the adapter's name, ``/v1/models`` lists the adapters with the base as their parent, and loading and
unloading answer vLLM's errors: a name loaded twice 400, a bad adapter 400 with the reason, an unknown name 404,
the routes 404 while runtime loading is off (test_lora_runtime.py has its rules). The adapters here are
safetensors files of zeros (or of ``value``)."""

from __future__ import annotations

import asyncio
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
from frontend_fakes import EOS, CharTokenizer, ScriptedEngine, out

from cbserve.frontend.lora_registry import (
    AdapterLimits,
    LoadLoRAAdapterRequest,
    LoRARegistry,
    UnloadLoRAAdapterRequest,
)
from cbserve.frontend.protocol import APIError, ChatCompletionRequest, CompletionRequest
from cbserve.frontend.responses.api import ResponsesAPI
from cbserve.frontend.responses.protocol import ResponsesRequest
from cbserve.frontend.serving import OpenAIServing
from cbserve.frontend.validation import ServedModel
from cbserve.scheduler.requests.lora import LoRARequest
from cbserve.scheduler.requests.request import EngineRequest
from cbserve.worker.loading.model_info import ModelInfo
from cbserve.worker.lora.files import read_content

SERVED = ServedModel(name="base", max_model_len=64, max_n=4, vocab_size=0x3000)
INFO = ModelInfo.from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
                                 "intermediate_size": 96})  # fmt: skip
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64), "gate_proj": (64, 96),
          "up_proj": (64, 96), "down_proj": (96, 64), "qkv_proj": (64, 128)}  # fmt: skip


_PACK = {"F32": "<f", "F16": "<e", "F64": "<d"}


def write_adapter(folder: Path, rank: int = 8, projections: tuple[str, ...] = ("q_proj", "v_proj"),
                  hidden: int = 64, dtype: str = "F32", value: float = 0.0, layers: int = 2) -> Path:
    """A PEFT LoRA folder whose safetensors file has the right header and every value ``value`` (of ``dtype``:
    F32, F16, BF16 or F64)."""
    item = struct.pack(_PACK.get(dtype, "<f"), value)
    item = item[2:] if dtype == "BF16" else item  # a bfloat16 is the upper half of a float32
    header: dict[str, Any] = {}
    offset = 0
    for layer in range(layers):
        for proj in projections:
            fan_in, fan_out = SHAPES[proj]
            fan_in = hidden if fan_in == 64 else fan_in
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}"
            for ab, shape in (("A", [rank, fan_in]), ("B", [fan_out, rank])):
                size = len(item) * shape[0] * shape[1]
                header[f"{prefix}.{proj}.lora_{ab}.weight"] = {"dtype": dtype, "shape": shape,
                                                                "data_offsets": [offset, offset + size]}  # fmt: skip
                offset += size
    folder.mkdir(parents=True)
    raw = json.dumps(header).encode()
    data = item * (offset // len(item))
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
                                                            "target_modules": list(projections)}))  # fmt: skip
    return folder


def _registry(tmp_path: Path, **adapters: Path) -> LoRARegistry:
    """Adapters ``add``ed (the operator's), runtime loading on under ``tmp_path``."""
    registry = LoRARegistry("base", AdapterLimits(INFO, max_lora_rank=16, allowed_dirs=(str(tmp_path),)))
    for name, path in adapters.items():
        registry.add(name, str(path))
    return registry


def _serving(registry: LoRARegistry) -> tuple[OpenAIServing, ScriptedEngine]:
    def script(req: EngineRequest) -> list[list[Any]]:
        return [[out(req.req_id, "ok", finished=True, reason="length")]]

    engine = ScriptedEngine(script)
    return OpenAIServing(SERVED, CharTokenizer(), engine, [EOS], registry), engine


def _status(call: Any) -> tuple[int, str, str | None]:
    with pytest.raises(APIError) as info:
        call()
    return info.value.status, info.value.message, info.value.param


def test_a_request_naming_an_adapter_runs_with_it_and_is_answered_under_its_name(tmp_path: Path) -> None:
    registry = _registry(tmp_path, sql=write_adapter(tmp_path / "sql"), chat=write_adapter(tmp_path / "chat"))
    serving, engine = _serving(registry)
    r = asyncio.run(serving.completions(CompletionRequest(model="sql", prompt="hi", max_tokens=2)))
    assert r.model == "sql" and r.choices[0].text == "ok"
    c = asyncio.run(serving.chat(ChatCompletionRequest(model="chat", messages=[{"role": "user", "content": "x"}])))
    assert c.model == "chat"
    base = asyncio.run(serving.completions(CompletionRequest(model="base", prompt=["a", "b"], max_tokens=2)))
    asyncio.run(serving.completions(CompletionRequest(prompt="no model named", max_tokens=2)))
    assert base.model == "base"
    sql, chat = registry.adapters()
    digest = read_content(tmp_path / "sql").digest  # the two hold the same bytes: kept once
    assert (sql, chat) == (LoRARequest("sql", 1, str(tmp_path / "sql"), digest),
                           LoRARequest("chat", 2, str(tmp_path / "chat"), digest))  # fmt: skip
    assert len(registry.contents) == 1 and registry.contents.get(digest) == read_content(tmp_path / "chat")
    assert [q.lora for q in engine.requests] == [sql, chat, None, None, None]  # both prompts of a batch: the base


def test_the_responses_api_runs_the_adapter_and_names_it(tmp_path: Path) -> None:
    serving, engine = _serving(_registry(tmp_path, sql=write_adapter(tmp_path / "sql")))
    api = ResponsesAPI(serving)
    r = asyncio.run(api.create(ResponsesRequest(model="sql", input="hi")))
    assert r.model == "sql" and engine.requests[-1].lora is not None and engine.requests[-1].lora.lora_name == "sql"
    assert _status(lambda: asyncio.run(api.create(ResponsesRequest(model="nope", input="hi"))))[:2] == (
        404, "The model `nope` does not exist.")


def test_unknown_models_are_404_naming_them_and_models_lists_the_adapters(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "sql")
    serving, engine = _serving(_registry(tmp_path, sql=path))
    req = CompletionRequest(model="sq", prompt="hi")
    assert _status(lambda: asyncio.run(serving.completions(req))) == (404, "The model `sq` does not exist.", "model")
    assert not engine.requests
    cards = [c.model_dump() for c in serving.models().data]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [("base", None, None), ("sql", "base", str(path))]
    assert serving.model_card("sql").parent == "base" and serving.model_card("base").root is None
    assert _status(lambda: serving.model_card("x"))[0] == 404
    plain, _ = _serving(LoRARegistry("base"))  # LoRA off: only the base model
    assert [c.id for c in plain.models().data] == ["base"]
    assert _status(lambda: plain.model_card("sql"))[0] == 404


def test_load_and_unload_change_what_resolves_and_each_load_gets_a_new_id(tmp_path: Path) -> None:
    registry = _registry(tmp_path)
    a, b = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "b", rank=4)
    assert registry.load(LoadLoRAAdapterRequest(lora_name="x", lora_path=str(a))) == (
        "Success: LoRA adapter 'x' added successfully.")
    first = registry.resolve("x")
    assert first is not None and first.lora_int_id == 1 and registry.resolve("base") is None
    assert registry.unload(UnloadLoRAAdapterRequest(lora_name="x")) == "Success: LoRA adapter 'x' removed successfully."
    assert _status(lambda: registry.resolve("x"))[0] == 404
    registry.load(LoadLoRAAdapterRequest(lora_name="x", lora_path=str(b)))
    again = registry.resolve("x")
    assert again is not None and again.lora_int_id == 2 and again.lora_path == str(b)  # a new id for a new load
    registry.load(LoadLoRAAdapterRequest(lora_name="x", lora_path=str(a), load_inplace=True))
    assert registry.resolve("x") == LoRARequest("x", 3, str(a), read_content(a).digest)
    assert read_content(b).digest in registry.contents  # b's bytes: kept for requests still running with it
    assert _status(lambda: registry.unload(UnloadLoRAAdapterRequest(lora_name="x", lora_int_id=2)))[0] == 404
    registry.unload(UnloadLoRAAdapterRequest(lora_name="x", lora_int_id=3))


def test_relative_paths_are_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_adapter(tmp_path / "rel")
    monkeypatch.chdir(tmp_path)
    lora = _registry(tmp_path).add("rel", "rel")
    assert lora.lora_path == str(tmp_path / "rel")  # the workers run in another working directory


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda p: None, "not a folder"),
        (lambda p: p.mkdir(), "no adapter_config.json"),
        (lambda p: write_adapter(p, rank=32), "rank 32 is over max_lora_rank 16"),
        (lambda p: write_adapter(p, hidden=128), "an adapter of another base model?"),
        (lambda p: p.mkdir() or (p / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}'),
         "not LoRA"),
        (lambda p: write_adapter(p, value=float("nan")), "not finite"),
        (lambda p: write_adapter(p, dtype="F64"), "float16, bfloat16 or float32"),
    ],
)
def test_a_bad_adapter_of_the_operator_is_a_400_with_the_reason_and_its_folder(
    tmp_path: Path, setup: Any, words: str
) -> None:
    folder = tmp_path / "bad"
    setup(folder)
    registry = _registry(tmp_path)
    status, message, param = _status(lambda: registry.add("bad", str(folder)))
    assert (status, param) == (400, "lora_path") and words in message and "'bad'" in message, message
    assert str(folder) in message and registry.adapters() == [] and len(registry.contents) == 0


def test_load_and_unload_errors(tmp_path: Path) -> None:
    registry = _registry(tmp_path, x=write_adapter(tmp_path / "x"))
    load = LoadLoRAAdapterRequest(lora_name="x", lora_path=str(tmp_path / "x"))
    assert _status(lambda: registry.load(load)) == (400, "The lora adapter 'x' has already been loaded.", "lora_name")
    named_base = LoadLoRAAdapterRequest(lora_name="base", lora_path=str(tmp_path / "x"))
    assert _status(lambda: registry.load(named_base))[0] == 400
    unload = UnloadLoRAAdapterRequest(lora_name="y")
    assert _status(lambda: registry.unload(unload)) == (404, "The lora adapter 'y' cannot be found.", "lora_name")
    off = LoRARegistry("base")
    for call in (lambda: off.load(load), lambda: off.unload(unload)):
        status, message, _ = _status(call)
        assert status == 404 and "LoRA is not enabled" in message and "--allow-runtime-lora-updating" in message


def test_a_request_in_flight_keeps_its_adapter_when_it_is_unloaded(tmp_path: Path) -> None:
    registry = _registry(tmp_path, sql=write_adapter(tmp_path / "sql"))
    serving, engine = _serving(registry)
    gate = asyncio.Event()

    def script(req: EngineRequest) -> list[list[Any]]:
        return [[out(req.req_id, "ok", finished=True, reason="stop")]]

    async def slow(request: EngineRequest) -> Any:
        engine.requests.append(request)
        yield []
        await gate.wait()
        for batch in script(request):
            yield batch

    engine.generate = slow  # type: ignore[method-assign]

    async def main() -> Any:
        task = asyncio.create_task(serving.completions(CompletionRequest(model="sql", prompt="hi")))
        while not engine.requests:
            await asyncio.sleep(0)
        registry.remove("sql")
        gate.set()
        return await task

    assert asyncio.run(main()).choices[0].text == "ok" and engine.requests[0].lora.lora_name == "sql"
    assert _status(lambda: asyncio.run(serving.completions(CompletionRequest(model="sql", prompt="hi"))))[0] == 404


def test_a_replica_mirrors_the_shared_sets_in_version_order(tmp_path: Path) -> None:
    """Served, one store keeps the app's adapters (cluster/stores/lora_store.py: a LoRARegistry's bookkeeping) and every
    ingress replica mirrors its ``AdapterSet``s: a newer set replaces what it serves, an older one is ignored;
    checking an adapter changes nothing; refusals and sets survive pickling (they cross Ray calls)."""
    store, replica = LoRARegistry("base"), _registry(tmp_path)
    checked = replica.check("x", str(write_adapter(tmp_path / "x")))
    folder = checked.folder
    assert folder == str(tmp_path / "x") and replica.adapters() == [] and replica.version == 0
    store.register("x", folder, content=checked.content)
    first = store.snapshot()
    assert first.adapters[0].digest == checked.content.digest and len(replica.contents) == 0  # bytes: the store's
    store.register("y", str(write_adapter(tmp_path / "y")))
    assert replica.apply(store.snapshot()) and not replica.apply(first)  # the older set arrived late
    assert [a.lora_name for a in replica.adapters()] == ["x", "y"] and replica.resolve("y").lora_int_id == 2
    store.unregister("x")
    assert replica.apply(pickle.loads(pickle.dumps(store.snapshot())))
    assert _status(lambda: replica.resolve("x"))[0] == 404 and replica.version == 3
    with pytest.raises(APIError) as taken:
        store.register("y", folder)
    copy = pickle.loads(pickle.dumps(taken.value))
    assert (copy.status, copy.param) == (400, "lora_name") and copy.message == taken.value.message
