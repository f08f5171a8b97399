"""The one stop rule (scheduler/requests/stop.py): unit checks of StopRule.check, then the engine paths that use
it (plain sampling, n > 1 forks, beam search) all agree with it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sched_fakes import EOS, expected_tokens, make_engine, next_token, req, run

import cbserve.scheduler
from cbserve.scheduler import RequestStatus, SamplingParams, StopRule

STOP, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
SCHEDULER_DIR = Path(cbserve.scheduler.__file__).parent


def rule(num_prompt: int = 4, max_tokens: int = 5, max_model_len: int = 100, eos: int | None = EOS, **kw) -> StopRule:
    return StopRule.for_request(SamplingParams(max_tokens=max_tokens, **kw), num_prompt, max_tokens, max_model_len, eos)


def test_eos_stops_unless_ignore_eos() -> None:
    assert rule().check(5, EOS) is STOP
    assert rule(ignore_eos=True).check(5, EOS) is None
    assert rule(ignore_eos=True).check(9, EOS) is LENGTH  # ignoring EOS never ignores the length
    assert rule(eos=None).check(5, EOS) is None  # a model without EOS
    assert rule().check(5, 7) is None


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    r = rule(stop_token_ids=[7, 8], ignore_eos=True)
    assert r.check(5, 7) is STOP and r.check(6, 8) is STOP and r.check(6, 9) is None


def test_min_tokens_holds_back_eos_and_stop_ids_but_not_length() -> None:
    r = rule(num_prompt=4, max_tokens=5, min_tokens=2, stop_token_ids=[7])
    assert r.check(5, EOS) is None and r.check(6, 7) is None  # 1 and 2 tokens generated: not more than 2
    assert r.check(7, EOS) is STOP and r.check(7, 7) is STOP
    assert rule(num_prompt=4, max_tokens=2, min_tokens=2).check(6, 5) is LENGTH


def test_max_tokens_and_max_model_len_give_length() -> None:
    assert rule(num_prompt=4, max_tokens=5).check(8, 1) is None
    assert rule(num_prompt=4, max_tokens=5).check(9, 1) is LENGTH
    assert rule(num_prompt=4, max_tokens=5, max_model_len=7).max_len == 7
    assert rule(num_prompt=4, max_tokens=5, max_model_len=7).check(7, 1) is LENGTH
    assert rule().check(9, EOS) is STOP  # EOS on the last allowed token is a stop, not a length


def test_engine_ignore_eos_runs_to_length() -> None:
    engine, _ = make_engine(eos_after={"a": 2, "b": 2})
    a = req("a", 5, max_tokens=4)
    engine.add_request(a)
    engine.add_request(req("b", 5, max_tokens=4, ignore_eos=True))
    col = run(engine)
    assert col.tokens[("a", 0)] == expected_tokens(a.prompt_token_ids, 4, eos_at=2)
    assert col.reasons[("a", 0)] == "stop"
    assert col.tokens[("b", 0)][1] == EOS and len(col.tokens[("b", 0)]) == 4
    assert col.reasons[("b", 0)] == "length"


def test_engine_min_tokens_and_stop_token_ids() -> None:
    engine, _ = make_engine(eos_after={"a": 1})
    prompt = [1, 2, 3, 4, 5]
    first = next_token(prompt)
    engine.add_request(req("a", prompt, max_tokens=6, min_tokens=2))  # the fake emits EOS anyway
    engine.add_request(req("s", prompt, max_tokens=6, stop_token_ids=[first]))
    col = run(engine)
    assert col.tokens[("a", 0)][0] == EOS and len(col.tokens[("a", 0)]) == 6  # EOS too early: ignored
    assert col.reasons[("a", 0)] == "length"
    assert col.tokens[("s", 0)] == [first] and col.reasons[("s", 0)] == "stop"


def test_engine_max_model_len_caps_unset_max_tokens() -> None:
    engine, _ = make_engine(max_model_len=12)
    engine.add_request(req("a", 9, max_tokens=None))
    col = run(engine)
    assert len(col.tokens[("a", 0)]) == 3 and col.reasons[("a", 0)] == "length"


def test_n_greater_than_one_children_use_the_rule() -> None:
    engine, _ = make_engine(eos_after={"a#1": 2})
    engine.add_request(req("a", 5, max_tokens=4, n=2, seed=1))
    col = run(engine)
    assert col.reasons == {("a", 0): "length", ("a", 1): "stop"}
    assert col.tokens[("a", 1)][-1] == EOS and len(col.tokens[("a", 1)]) == 2


@pytest.mark.parametrize(("min_tokens", "want_stop"), [(0, True), (6, False)])
def test_beam_search_ends_beams_by_the_same_rule(min_tokens: int, want_stop: bool) -> None:
    """EOS becomes a candidate from the 2nd output token; with min_tokens=6 it may not end a beam."""
    engine, _ = make_engine(eos_after={"b": 2})
    # A fixed prompt whose EOS hypothesis ranks among the beams (reference_beam_search agrees): for ~1 prompt
    # in 100 the fake's EOS candidate never makes the top 2, and no beam can end with "stop" at all.
    prompt = [11, 12, 13, 14, 15]
    engine.add_request(
        req("b", prompt, max_tokens=6, n=2, use_beam_search=True, temperature=0.0, min_tokens=min_tokens)
    )
    col = run(engine)
    reasons = {col.reasons[("b", i)] for i in range(2)}
    finals = [col.final[("b", i)] for i in range(2)]
    assert ("stop" in reasons) == want_stop
    if not want_stop:
        assert reasons == {"length"} and all(len(f) == 6 for f in finals)  # (the fake never masks EOS)
    else:
        assert any(f[-1] == EOS for f in finals)


def _imports(module: str) -> set[str]:
    """The scheduler modules (by their file's name) that ``module`` imports."""
    (path,) = SCHEDULER_DIR.rglob(f"{module}.py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cbserve.scheduler"):
            found.add(node.module.rsplit(".", 1)[-1])  # type: ignore[union-attr]
            found.update(a.name for a in node.names)
    return found


def test_dependencies_are_one_way() -> None:
    """beam search decides, the output processor applies; policies answer, the scheduler asks."""
    assert "sequence_updater" not in _imports("beam_search")
    assert "beam_search" in _imports("sequence_updater")
    assert "scheduler" not in _imports("policies") and "engine_core" not in _imports("policies")
    assert "policies" in _imports("scheduler")


def test_the_stop_rule_lives_in_one_module() -> None:
    """Only stop.py compares tokens with EOS / stop ids or lengths with max_len."""
    for path in SCHEDULER_DIR.rglob("*.py"):
        if path.name in ("stop.py", "sampling_params.py"):
            continue
        text = path.read_text()
        for needle in ("min_stop_len", "stop_token_ids", "max_len ", "eos_token_id ==", "== group.eos"):
            assert needle not in text, f"{path.name} decides a stop itself ({needle!r})"
