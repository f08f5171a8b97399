"""Structured output in the worker, on CPU without a server: the sampler's bitmask path, grammar
compilation errors and caching, and a tiny random model (SmolLM2's tokenizer) generating through a real
EngineCore under a regex / choice grammar, with n > 1, seeds and preemption by recompute."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from worker_testlib import run_engine

from cbserve.scheduler.requests.sampling_params import SamplingParams, StructuredSpec
from cbserve.worker.config import ModelConfig
from cbserve.worker.runner.executor import LocalExecutor
from cbserve.worker.sampling.sampler import Sampler, SamplingRow
from cbserve.worker.sampling.structured import GrammarError, StructuredOutputs

xgr = pytest.importorskip("xgrammar")
BLOCK = 4
REGEX = r"(ab|cd)[0-9]{2,4}"
CHOICES = ["yes", "no", "perhaps not"]


def _mask(rows: int, vocab: int, allowed: dict[int, list[int]]) -> torch.Tensor:
    mask = xgr.allocate_token_bitmask(rows, vocab)
    for r, toks in allowed.items():
        mask[r] = 0
        for t in toks:
            mask[r, t // 32] |= 1 << (t % 32)
    return mask


@pytest.mark.parametrize("vocab", [1, 31, 100, 49152, 49155])
def test_c_kernel_mask_sets_exactly_the_forbidden_tokens(kernels: object, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (5, words + 2), dtype=torch.int32, generator=gen)  # padded rows
    mask[1] = -1  # all allowed
    mask[2, : words // 2] = 0  # mostly forbidden
    logits = torch.randn(5, vocab + 3, generator=gen)[:, :vocab]  # rows ld floats apart
    t = torch.arange(vocab)
    allowed = (mask[:, t // 32] >> (t % 32)) & 1  # bit t % 32 of word t // 32 (xgrammar's layout)
    ref = logits.masked_fill(allowed == 0, float("-inf"))
    if vocab > 1:  # and what xgrammar's own kernel gives (not for one token: it writes past the row there)
        theirs = logits.clone()
        xgr.apply_token_bitmask_inplace(theirs, mask, vocab_size=vocab)
        assert torch.equal(theirs, ref)
    ours = logits.clone()
    assert kernels.apply_token_bitmask_(ours, mask) is ours  # type: ignore[attr-defined]
    assert torch.equal(ours, ref) and torch.equal(ours[1], logits[1])
    with pytest.raises(ValueError, match="bitmask must be an int32"):
        kernels.apply_token_bitmask_(ours, mask.long())  # type: ignore[attr-defined]


@pytest.mark.parametrize("with_kernels", [False, True])
def test_sampler_applies_the_bitmask_to_constrained_rows_only(kernels: object, with_kernels: bool) -> None:
    vocab = 100
    logits = torch.randn(3, vocab)
    logits[:, 50] = 30.0  # the favourite everywhere
    mask = _mask(3, vocab, {0: [3, 7], 2: [64, 99]})
    kinds = ((0.0, None), (0.0, None), (1.0, 5))
    rows = [SamplingRow(SamplingParams(temperature=t), [1, 2], 2, seed=s) for t, s in kinds]
    for _ in range(20):
        tokens, _ = Sampler([2], kernels if with_kernels else None)(logits.clone(), rows,
                                                                    mask)  # type: ignore[arg-type]
        assert tokens[0] == (3 if logits[0, 3] > logits[0, 7] else 7) and tokens[1] == 50 and tokens[2] in (64, 99)
    logits_before = logits.clone()
    Sampler([2])(logits, rows, mask)
    assert torch.equal(logits, logits_before)  # the caller's logits are not masked in place


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama over SmolLM2's real tokenizer (xgrammar needs a real vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cbserve.worker.loading.model_loader import resolve_model

    folder = tmp_path_factory.mktemp("structured") / "tiny"
    src = resolve_model(None).folder
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def structured(tiny_model: Path) -> StructuredOutputs:
    return StructuredOutputs(tiny_model, 49152, [2])


@pytest.mark.parametrize(
    ("spec", "match"),
    [(StructuredSpec("json", '{"type": "objectx"}'), "objectx"), (StructuredSpec("json", "{not json"), "malformed"),
     (StructuredSpec("regex", "a(b"), "parenthesis"), (StructuredSpec("grammar", 'root ::= "a" |'), "EBNF"),
     (StructuredSpec("choice", "[]"), "non-empty"), (StructuredSpec("choice", '"x"'), "list")],
)  # fmt: skip
def test_bad_specs_name_the_problem(structured: StructuredOutputs, spec: StructuredSpec, match: str) -> None:
    with pytest.raises(GrammarError, match=match) as info:
        structured.compilers.get(spec)
    assert spec.kind in str(info.value) and "/project/cpp" not in str(info.value)


def test_grammars_are_cached_and_matchers_follow_the_tokens(structured: StructuredOutputs) -> None:
    spec = StructuredSpec("choice", json.dumps(CHOICES))
    assert structured.compilers.get(spec) is structured.compilers.get(StructuredSpec("choice", json.dumps(CHOICES)))
    tok = structured.compilers.compiler  # noqa: F841 - built
    from cbserve.worker.sampling.structured import load_grammar_tokenizer

    tokenizer = load_grammar_tokenizer(structured.model_folder)
    prompt = [1, 5]
    no_ids = tokenizer("no", add_special_tokens=False)["input_ids"]
    owner = object()
    row = SamplingRow(SamplingParams(structured=spec), prompt + no_ids, len(prompt))
    mask = structured.bitmask([("s", owner, row)])
    allowed = [t for t in range(49152) if mask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [2]  # "no" is complete: only EOS
    row0 = SamplingRow(SamplingParams(structured=spec), list(prompt), len(prompt))
    allowed = [t for t in range(49152) if structured.bitmask([("s", object(), row0)])[0, t // 32] >> (t % 32) & 1]
    assert 2 not in allowed and no_ids[0] in allowed and len(allowed) < 50  # a new owner (preempted): rebuilt
    plain = SamplingRow(SamplingParams(), list(prompt), len(prompt))
    assert structured.bitmask([("p", object(), plain)]) is None
    structured.drop(["s"])
    assert "s" not in structured.matchers


def _run(folder: Path, num_blocks: int, requests: list, async_scheduling: bool = False) -> object:
    cfg = ModelConfig(model=str(folder), max_model_len=256, device="cpu")
    ex = LocalExecutor(dataclasses.replace(cfg, block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8),
                       num_blocks=num_blocks, progress=False)
    try:
        return run_engine(ex, requests, block_size=BLOCK, num_blocks=num_blocks, max_num_batched_tokens=64,
                          async_scheduling=async_scheduling)  # fmt: skip
    finally:
        ex.shutdown()


def test_generation_follows_the_grammar_with_n_seeds_and_preemption(tiny_model: Path) -> None:
    from cbserve.worker.sampling.structured import load_grammar_tokenizer

    tok = load_grammar_tokenizer(tiny_model)
    regex = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=24, structured=StructuredSpec("regex", REGEX))
    spec = StructuredSpec("choice", json.dumps(CHOICES))
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured=spec)
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    prompt = tok("Answer with a code: " * 4, add_special_tokens=False)["input_ids"]
    reqs = [("r", prompt, regex), ("c", prompt[:3], choice), ("f", prompt[:4], free), ("r2", prompt[1:], regex)]
    roomy = _run(tiny_model, 256, reqs)
    tight = _run(tiny_model, 18, reqs)
    assert tight.num_preemptions > 0 and roomy.num_preemptions == 0
    assert tight.tokens == roomy.tokens  # seeded: the same outputs after recompute (matchers rebuilt)
    for rid in ("r", "r2"):
        for i in (0, 1):
            toks = roomy.tokens[rid][i]
            assert toks[-1] == 2 and roomy.finish[rid][i] == "stop", toks  # ended by EOS once complete
            assert re.fullmatch(REGEX, tok.decode(toks[:-1])), tok.decode(toks)
    assert tok.decode(roomy.tokens["c"][0][:-1]) in CHOICES
    assert roomy.tokens["r"][0] != roomy.tokens["r"][1] or roomy.tokens["r"][0] != roomy.tokens["r2"][0]
    assert len(roomy.tokens["f"][0]) == 40  # an unconstrained neighbour is untouched


def test_structured_output_under_async_scheduling(tiny_model: Path) -> None:
    """Async scheduling (as the served engine runs): step N+1 is scheduled and run before the scheduler has
    step N's token, so each matcher must advance from the worker's own samples. Greedy and seeded outputs
    equal the synchronous run's, with and without preemption, and every output ends at its grammar's end."""
    from cbserve.worker.sampling.structured import load_grammar_tokenizer

    tok = load_grammar_tokenizer(tiny_model)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    as_json = SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredSpec("json", json.dumps(schema)))
    regex = SamplingParams(temperature=1.0, n=2, seed=11, max_tokens=24, structured=StructuredSpec("regex", REGEX))
    spec = StructuredSpec("choice", json.dumps(CHOICES))
    choice = SamplingParams(temperature=0.8, seed=5, max_tokens=24, structured=spec)
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True)
    prompt = tok("Give the answer as JSON: " * 4, add_special_tokens=False)["input_ids"]
    reqs = [("j", prompt, as_json), ("r", prompt[2:], regex), ("c", prompt[:5], choice), ("f", prompt[:4], free)]
    sync = _run(tiny_model, 256, reqs)
    overlapped = _run(tiny_model, 256, reqs, async_scheduling=True)
    tight = _run(tiny_model, 20, reqs, async_scheduling=True)
    assert tight.num_preemptions > 0
    assert overlapped.tokens == sync.tokens and tight.tokens == sync.tokens
    assert overlapped.finish == sync.finish
    obj = json.loads(tok.decode(sync.tokens["j"][0][:-1]))
    assert set(obj) == {"a", "b"} and isinstance(obj["a"], int) and obj["b"] in ("x", "yz")
    for i in (0, 1):
        toks = sync.tokens["r"][i]
        assert toks[-1] == 2 and sync.finish["r"][i] == "stop" and re.fullmatch(REGEX, tok.decode(toks[:-1]))
    assert tok.decode(sync.tokens["c"][0][:-1]) in CHOICES and sync.finish["c"][0] == "stop"
    assert len(sync.tokens["f"][0]) == 30
