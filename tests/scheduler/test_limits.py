"""resolve_max_tokens: the one length check shared by the engine and the HTTP edge."""

from __future__ import annotations

import pickle

import pytest
from sched_fakes import make_engine, req

from cbserve.scheduler import RequestRejectedError, resolve_max_tokens


def test_max_tokens_kept_or_filled_with_the_room_left() -> None:
    assert resolve_max_tokens(10, 5, 100) == 5
    assert resolve_max_tokens(10, 90, 100) == 90  # exactly fits
    assert resolve_max_tokens(10, None, 100) == 90
    assert resolve_max_tokens(99, None, 100) == 1


def test_empty_prompt() -> None:
    with pytest.raises(RequestRejectedError, match="prompt is empty") as e:
        resolve_max_tokens(0, 5, 100)
    assert e.value.param == "prompt"


def test_no_room_to_generate_uses_both_wordings() -> None:
    with pytest.raises(RequestRejectedError) as e:
        resolve_max_tokens(100, None, 100)
    msg = str(e.value)
    assert "no room to generate" in msg
    assert msg.startswith(
        "This model's maximum context length is 100 tokens. However, you requested 100 tokens "
        "(100 in the prompt, 0 for the completion)."
    )
    assert e.value.param == "prompt"


@pytest.mark.parametrize(("num_prompt", "param"), [(100, "max_tokens"), (150, "prompt")])
def test_too_long_names_the_field(num_prompt: int, param: str) -> None:
    with pytest.raises(RequestRejectedError) as e:
        resolve_max_tokens(num_prompt, 29, 128)
    asked = num_prompt + 29
    assert str(e.value).startswith(
        f"This model's maximum context length is 128 tokens. However, you requested {asked} tokens "
        f"({num_prompt} in the prompt, 29 for the completion)."
    )
    assert f"prompt ({num_prompt} tokens) + max_tokens (29) = {asked} exceeds max_model_len (128)" in str(e.value)
    assert e.value.param == param


def test_error_keeps_param_through_pickle() -> None:
    """Errors cross Ray hops pickled."""
    err = RequestRejectedError("nope", param="max_tokens")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "nope" and back.param == "max_tokens"
    assert RequestRejectedError("plain").param is None


def test_engine_admission_uses_it() -> None:
    engine, _ = make_engine(max_model_len=64)
    with pytest.raises(RequestRejectedError, match="maximum context length is 64 tokens") as e:
        engine.add_request(req("a", 60, max_tokens=5))
    assert e.value.param == "max_tokens"
    engine.add_request(req("b", 60, max_tokens=None))
    assert engine.groups["b"].stop.max_len == 64
