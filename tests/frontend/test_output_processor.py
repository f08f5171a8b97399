"""The one output processor: stop strings across token boundaries (and the engine told to finish), choice
indices of n > 1 over several prompts, usage counts, EOS ids, best_of's final outputs."""

from __future__ import annotations

from frontend_fakes import EOS, CharTokenizer, ids, out

from cbserve.frontend.output import OutputProcessor
from cbserve.scheduler.outputs import TokenLogprob
from cbserve.scheduler.requests.sampling_params import SamplingParams


def _processor(eos: tuple[int, ...] = (EOS,)) -> tuple[OutputProcessor, list[tuple[str, int]]]:
    finished: list[tuple[str, int]] = []
    return OutputProcessor(CharTokenizer(), eos, lambda r, i: finished.append((r, i))), finished


def test_stop_string_split_over_tokens_ends_the_sequence_and_tells_the_engine() -> None:
    proc, finished = _processor()
    proc.add_request("r", ids("Say:"), SamplingParams(stop=("STOP",), max_tokens=50))
    texts = []
    for piece in ["ab", "cS", "T", "O"]:
        d = proc.process(out("r", piece))
        assert d is not None and d.finish_reason is None
        texts.append(d.text)
    assert "".join(texts) == "abc"  # "STO" is held back: it may start "STOP"
    d = proc.process(out("r", "Pxy"))
    assert d is not None and (d.text, d.finish_reason) == ("", "stop")
    assert finished == [("r", 0)]  # the engine was still generating: told once
    assert proc.process(out("r", "more", finished=True, reason="stop")) is None  # ended: ignored
    state = proc.pop("r")
    assert state is not None and state.finished
    o = state.result.outputs[0]
    assert (o.text, o.finish_reason, o.stop_reason) == ("abc", "stop", "STOP")
    assert o.token_ids == ids("abcSTOPxy")  # the tokens up to the stop string's step


def test_held_back_text_is_released_when_it_is_no_stop_string() -> None:
    proc, finished = _processor()
    proc.add_request("r", [], SamplingParams(stop=("STOP",), include_stop_str_in_output=True))
    assert proc.process(out("r", "ST")).text == ""
    assert proc.process(out("r", "Ox")).text == "STOx"
    d = proc.process(out("r", "ST", finished=True, reason="length"))
    assert (d.text, d.finish_reason) == ("ST", "length") and finished == []
    proc.add_request("s", [], SamplingParams(stop=("STOP",), include_stop_str_in_output=True))
    d = proc.process(out("s", "aSTOPb", finished=True, reason="length"))
    assert (d.text, d.finish_reason) == ("aSTOP", "stop") and finished == []  # already finished: not told


def test_choice_indices_and_usage_for_n_over_several_prompts() -> None:
    proc, _ = _processor()
    sp = SamplingParams(n=2, max_tokens=4)
    proc.add_request("a", ids("p1"), sp, choice_offset=0)
    proc.add_request("b", ids("pp2"), sp, choice_offset=2)
    deltas = [proc.process(o) for o in (
        out("a", "x", index=1), out("b", "y", index=0), out("b", "zz", index=1, finished=True, reason="length"),
        out("a", "w", index=0, finished=True, reason="stop"), out("a", "v", index=1, finished=True, reason="stop"),
        out("b", "u", index=0, finished=True, reason="length"), out("b", "t", index=5),
    )]
    assert [d.index for d in deltas[:6]] == [1, 2, 3, 0, 1, 2] and deltas[6] is None  # index past n: dropped
    a, b = proc.requests["a"], proc.requests["b"]
    assert a.finished and b.finished
    assert [i for i, _, _ in a.choices() + b.choices()] == [0, 1, 2, 3]
    assert [o.text for _, o, _ in b.choices()] == ["yu", "zz"]
    assert (a.num_prompt_tokens, a.num_completion_tokens) == (2, 3)
    assert (b.num_prompt_tokens, b.num_completion_tokens) == (3, 4)


def test_eos_ids_tokenizer_first_others_stop_unless_ignore_eos() -> None:
    proc, _ = _processor(eos=(7, EOS, 9))
    assert (proc.eos_token_id, proc.extra_eos_token_ids) == (EOS, (7, 9))
    req = proc.add_request("r", [65], SamplingParams(stop_token_ids=(9,)))
    assert req.eos_token_id == EOS and req.sampling_params.stop_token_ids == (9, 7)
    req = proc.add_request("s", [65], SamplingParams(ignore_eos=True))
    assert req.sampling_params.stop_token_ids == ()
    assert proc.requests["r"].params.stop_token_ids == (9,)  # the caller's params stay as given


def test_final_outputs_replace_the_stream_and_keep_logprobs() -> None:
    proc, _ = _processor()
    proc.add_request("r", [65], SamplingParams(n=1, best_of=2, logprobs=0, temperature=1.0))
    lps = [TokenLogprob(ord(c), -0.5, 1) for c in "hi!"]
    final = out("r", "hi!", finished=True, reason="stop", final_token_ids=ids("hi!"), new_logprobs=lps,
                cumulative_logprob=-1.5, num_cached_tokens=1)
    d = proc.process(final)
    o = proc.requests["r"].result.outputs[0]
    assert d.text == "hi!" and o.text == "hi!" and o.logprobs == lps and o.cumulative_logprob == -1.5
    assert proc.requests["r"].result.num_cached_tokens == 1
