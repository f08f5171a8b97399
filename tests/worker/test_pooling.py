"""Embeddings offline (``LLM(model, runner="pooling").embed``) against sentence-transformers' ``encode`` on tiny random
Qwen3 and Llama folders, for each pooling mode cbserve computes (the sentence-transformers files written by hand, as
published models ship them), with prompts long enough to be prefilled in several chunks; and the pooling config
reader's refusals."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from family_testlib import COMMON, VOCAB

from cbserve import LLM
from cbserve.worker.loading.pooling_config import PoolingConfig, read_pooling_config

pytestmark = pytest.mark.timeout(600)
st = pytest.importorskip("sentence_transformers")

# two-letter words: every word one token (BOS, EOS and padding are 1, 2 and 0)
WORDS = ["<pad>", "<s>", "</s>"] + ["".join(p) for p in itertools.product("abcdefghijklmnopqr", repeat=2)][: VOCAB - 3]
LENGTHS = [1, 5, 13, 40, 27, 64]
TEXTS = [" ".join(WORDS[(7 * i + 11 * j * j) % 300 + 3] for j in range(n)) for i, n in enumerate(LENGTHS)]
ST_MODE = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
           "max": "pooling_mode_max_tokens"}
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True)),
}


def save_word_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<pad>",
                            pad_token="<pad>").save_pretrained(folder)


def make_embedding_model(folder: Path, family: str, pooling: str | None, normalize: bool = True,
                         extra_config: dict[str, Any] | None = None) -> Path:
    """A tiny random ``family`` model with sentence-transformers files for ``pooling`` (None: no files at all,
    the default last-token + normalize)."""
    import transformers

    cfg_name, model_name, extra = MODELS[family]
    torch.manual_seed(99)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **(extra_config or {})})
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # norms initialised to 1: make the final norm matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape))
    model.save_pretrained(folder)
    save_word_tokenizer(folder)
    if pooling is None:
        return folder
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    flags = {flag: flag == ST_MODE[pooling] for flag in ST_MODE.values()}
    pool = {"word_embedding_dimension": COMMON["hidden_size"], **flags, "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return folder


def reference(folder: Path, texts: list[str], default_pooling: bool = False) -> torch.Tensor:
    """sentence-transformers' embeddings of ``texts`` (``default_pooling``: a folder without its files, built as
    last-token pooling + Normalize, what cbserve assumes for a decoder model)."""
    if default_pooling:
        try:  # sentence-transformers >= 6
            from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
        except ImportError:
            from sentence_transformers.models import Normalize, Pooling, Transformer
        modules = [Transformer(str(folder)), Pooling(COMMON["hidden_size"], "lasttoken"), Normalize()]
        model = st.SentenceTransformer(modules=modules, device="cpu")
    else:
        model = st.SentenceTransformer(str(folder), device="cpu")
    return torch.as_tensor(model.encode(texts, batch_size=4, convert_to_numpy=True))


def embed(folder: Path, texts: list[str], **kw: Any) -> torch.Tensor:
    llm = LLM(str(folder), runner="pooling", max_model_len=128, block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=kw.pop("max_num_batched_tokens", 16), cpu_ops=kw.pop("cpu_ops", "auto"),
              progress=False, device="cpu", **kw)
    try:
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    finally:
        llm.shutdown()


def _check_close(ours: torch.Tensor, ref: torch.Tensor, normalized: bool) -> None:
    assert ours.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert cos.min() >= 0.9999, cos
    if normalized:
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ours), dtype=ours.dtype), atol=1e-4)
    else:  # the magnitudes match too
        assert torch.allclose(ours.norm(dim=-1), ref.norm(dim=-1), rtol=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls", "max"])
def test_embed_matches_sentence_transformers(tmp_path: Path, family: str, pooling: str) -> None:
    torch.set_num_threads(1)
    normalize = pooling != "max"  # one pipeline without Normalize: raw vectors must match as well
    folder = make_embedding_model(tmp_path / family, family, pooling, normalize)
    cfg = read_pooling_config(folder)
    assert (cfg.pooling_type, cfg.normalize, cfg.source) == (pooling, normalize, "sentence-transformers")
    # 16-token steps: the long prompts are pooled over several chunks, batched with the short ones
    _check_close(embed(folder, TEXTS), reference(folder, TEXTS), normalize)


def test_default_pooling_is_last_token_normalized_and_torch_ops_agree(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    folder = make_embedding_model(tmp_path / "plain", "qwen3", None)
    assert read_pooling_config(folder) == PoolingConfig()
    ref = reference(folder, TEXTS, default_pooling=True)
    _check_close(embed(folder, TEXTS, cpu_ops="torch", max_num_batched_tokens=256), ref, True)


def test_embed_truncates_and_the_runners_refuse_each_others_calls(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    folder = make_embedding_model(tmp_path / "m", "llama", "mean")
    llm = LLM(str(folder), runner="pooling", max_model_len=32, block_size=4, num_kv_blocks=64, progress=False,
              device="cpu")
    try:
        long = TEXTS[3]  # 40 tokens: over max_model_len
        with pytest.raises(Exception, match="maximum context length is 32"):
            llm.embed(long, use_tqdm=False)
        out = llm.embed([long, TEXTS[1]], truncate_prompt_tokens=32, use_tqdm=False)
        assert [len(o.prompt_token_ids) for o in out] == [32, 5]
        tail = " ".join(long.split()[-32:])
        _check_close(torch.tensor([out[0].outputs.embedding]), reference(folder, [tail]), True)
        with pytest.raises(ValueError, match="runner='generate'"):
            llm.generate("ab cd", use_tqdm=False)
        assert not llm.engine.config.cache.enable_prefix_caching
    finally:
        llm.shutdown()


def test_pooling_config_reader(tmp_path: Path) -> None:
    def write(name: str, data: Any) -> None:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(data))

    write("config.json", {"model_type": "qwen3", "matryoshka_dimensions": [32, 16, 64]})
    assert read_pooling_config(tmp_path) == PoolingConfig(matryoshka=True, matryoshka_dimensions=(16, 32, 64))
    write("config.json", {"model_type": "qwen3"})
    write("config_sentence_transformers.json", {"is_matryoshka": True})
    modules = [{"path": "", "type": "sentence_transformers.models.Transformer"},
               {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    write("modules.json", modules)
    write("1_Pooling/config.json", {"embedding_dimension": 64, "pooling_mode": "cls"})  # sentence-transformers 5
    assert read_pooling_config(tmp_path) == PoolingConfig("cls", False, True, None, "sentence-transformers")
    write("1_Pooling/config.json", {"pooling_mode": "weightedmean"})
    with pytest.raises(ValueError, match="weightedmean"):
        read_pooling_config(tmp_path)
    write("1_Pooling/config.json", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True})
    with pytest.raises(ValueError, match="not supported"):
        read_pooling_config(tmp_path)
    write("1_Pooling/config.json", {"pooling_mode_cls_token": False, "pooling_mode_max_tokens": True})
    write("modules.json", [*modules, {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}])
    assert read_pooling_config(tmp_path) == PoolingConfig("max", True, True, None, "sentence-transformers")
    write("modules.json", [*modules, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(ValueError, match="Dense"):
        read_pooling_config(tmp_path)
