"""Tokenizer loading, chat template and incremental detokenization (bundled SmolLM2 tokenizer)."""

from __future__ import annotations

import pytest

from cbserve.frontend.text.detokenizer import IncrementalDetokenizer, ids_decoder
from cbserve.frontend.text.tokenizer import apply_chat_template, load_tokenizer


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return load_tokenizer(None)


def _stream(tok, text: str, prompt: str = "", **kw) -> tuple[list[str], IncrementalDetokenizer]:  # noqa: ANN001
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    ids = tok(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    pieces = []
    for t in ids:
        upd = d.add_tokens([t])
        pieces.append(upd.new_text)
        if upd.stopped:
            return pieces, d
    pieces.append(d.flush())
    return pieces, d


@pytest.mark.parametrize(
    "text", ["Hello world, how are you?", "naïve café — 日本語のテキスト 🤖🚀 done", " spaced  out\n\nlines"]
)
def test_streamed_text_equals_full_decode(tok, text: str) -> None:  # noqa: ANN001
    pieces, d = _stream(tok, text, prompt="Say:")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert "".join(pieces) == tok.decode(ids) == d.text
    assert all("\ufffd" not in p for p in pieces)  # partial UTF-8 is never emitted


def test_stop_string_truncates_output(tok) -> None:  # noqa: ANN001
    text = "One two three. STOP here and more text"
    pieces, d = _stream(tok, text, stop=["STOP"])
    assert d.stopped and "".join(pieces) == "One two three. " == d.text
    pieces, d = _stream(tok, text, stop=["STOP", "two"], include_stop_str_in_output=True)
    assert "".join(pieces) == "One two" == d.text


def test_text_that_may_start_a_stop_string_is_held_back(tok) -> None:  # noqa: ANN001
    ids = tok("abc xy", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, [], stop=["xyz"])
    emitted = "".join(d.add_tokens([t]).new_text for t in ids)
    assert not emitted.endswith("xy") and not d.stopped
    assert emitted + d.flush() == "abc xy"


def test_chat_template_renders_a_prompt(tok) -> None:  # noqa: ANN001
    ids = apply_chat_template(tok, [{"role": "user", "content": "Hi there"}])
    text = tok.decode(ids)
    assert "Hi there" in text and text.rstrip().endswith("assistant")
    with pytest.raises(ValueError):
        apply_chat_template(tok, [{"content": "no role"}])


def test_ids_decoder_equals_the_tokenizers_decode(tok) -> None:  # noqa: ANN001
    import random

    rng = random.Random(0)
    special = [tok.eos_token_id, tok.bos_token_id, *tok.all_special_ids]
    for skip in (True, False):
        decode = ids_decoder(tok, skip)
        for _ in range(200):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] + rng.sample(special, 1)
            rng.shuffle(ids)
            assert decode(ids) == tok.decode(ids, skip_special_tokens=skip)


def test_ids_decoder_keeps_what_the_wrapper_adds() -> None:
    """A tokenizer that cleans up tokenization spaces, or overrides decode, is decoded through its wrapper."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, ".": 3, "'": 4, "s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    wp = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = [1, 2, 3, 1, 4, 5]
    assert backend.decode(ids) != wp.decode(ids) == ids_decoder(wp, True)(ids)  # "world ." vs "world."

    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kw):  # noqa: ANN001, ANN003, ANN201
            return super().decode(token_ids, skip_special_tokens, **kw).upper()

    loud = Shouting(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)
    assert ids_decoder(loud, True)([1, 2]) == "HELLO WORLD"
