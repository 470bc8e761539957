"""IncrementalDetokenizer with SmolLM2's real tokenizer: the deltas add up to a full decode, and
no part of a stop string ever leaks."""

from __future__ import annotations

import random
from typing import Any

import pytest

from worker.engine.model.model_loader import load_tokenizer
from worker.engine.sampling.detokenizer import IncrementalDetokenizer, _PrefixOffsetDecoder

MULTILINGUAL = "Grüße aus Köln! 東京は晴れ 🌞🌧️ — naïve café, 👩‍👩‍👧 family; Ελληνικά, русский, العربية. Done ✅"


@pytest.fixture(scope="module")
def tokenizer(default_model_name: str) -> Any:
    return load_tokenizer(default_model_name)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas = []
    for token_id in ids:
        delta, stopped = detok.add(token_id)
        deltas.append(delta)
        if stopped:
            return deltas, True
    deltas.append(detok.finish())
    return deltas, False


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class SlowTokenizer:
    """A tokenizer without a Rust backend, to exercise the prefix-offset fallback."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("slow", [False, True])
def test_deltas_of_random_token_sequences_add_up_to_a_full_decode(
    tokenizer: Any, skip_special_tokens: bool, slow: bool
) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(40 if slow else 200):
        # Low ids are special tokens and single bytes: the hard cases, so draw them often.
        output = [
            rng.randrange(300) if rng.random() < 0.4 else rng.randrange(vocab) for _ in range(rng.randrange(1, 30))
        ]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        detok = IncrementalDetokenizer(
            SlowTokenizer(tokenizer) if slow else tokenizer, prompt, skip_special_tokens=skip_special_tokens
        )
        deltas, _ = stream(detok, output)
        expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected
        assert detok.text == expected


@pytest.mark.parametrize("slow", [False, True])
def test_multibyte_text_streams_whole_characters(tokenizer: Any, slow: bool) -> None:
    ids = encode(tokenizer, MULTILINGUAL)
    prompt = encode(tokenizer, "Say something:")
    detok = IncrementalDetokenizer(SlowTokenizer(tokenizer) if slow else tokenizer, prompt)
    deltas, stopped = stream(detok, ids)
    assert not stopped and "".join(deltas) == MULTILINGUAL
    assert not any("\ufffd" in d for d in deltas)  # never a half character
    assert sum(1 for d in deltas if d == "") > 3  # emoji bytes were held back, then released


def test_the_fallback_decoder_is_used_without_a_rust_backend(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(SlowTokenizer(tokenizer), [])
    assert isinstance(detok._decoder, _PrefixOffsetDecoder)


def sentencepiece_style() -> Any:
    """A tiny tokenizer whose decoder strips the first leading space, as Llama-2's does."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3, "<0xF0>": 4, "<0x9F>": 5, "<0x98>": 6, "<0x80>": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


@pytest.mark.parametrize("slow", [False, True])
def test_the_prompt_gives_the_first_output_token_its_leading_space(slow: bool) -> None:
    tok = sentencepiece_style()
    assert tok.decode([2]) == "world"  # decoded alone, the space is stripped
    detok = IncrementalDetokenizer(SlowTokenizer(tok) if slow else tok, [1])
    deltas, _ = stream(detok, [2, 3, 4, 5, 6, 7, 2, 4, 5])
    assert deltas == [" world", "!", "", "", "", "\U0001f600", " world", "", "", "\ufffd\ufffd"]


def test_an_output_ending_inside_a_character_is_flushed_like_a_full_decode(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 🌞")
    truncated = ids[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, _ = stream(detok, truncated)
    assert deltas[-1].endswith("\ufffd")  # from finish(), not before
    assert "".join(deltas) == tokenizer.decode(truncated)


def test_special_tokens_are_skipped_or_kept(tokenizer: Any) -> None:
    ids = [*encode(tokenizer, "Hi there"), tokenizer.eos_token_id]
    skipped, _ = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True), ids)
    kept, _ = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False), ids)
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi there" + tokenizer.eos_token


def assert_no_leak(deltas: list[str], final_text: str) -> None:
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert final_text.startswith(emitted)


def test_a_stop_string_spanning_tokens_truncates_without_leaking(tokenizer: Any) -> None:
    text = "The light turned red. STOP HERE please, then continue."
    ids = encode(tokenizer, text)
    stop = "STOP HERE"
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it really spans tokens
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    deltas, stopped = stream(detok, ids)
    assert stopped
    assert "".join(deltas) == "The light turned red. " == detok.text
    assert_no_leak(deltas, detok.text)
    assert detok.finish() == ""
    assert detok.add(ids[0]) == ("", True)


def test_text_that_only_looks_like_a_stop_is_held_then_released(tokenizer: Any) -> None:
    text = "We saw a STOP sign, not a STOP HERE... well."
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP HERE!"])
    emitted = ""
    held = False
    for token_id in ids:
        delta, stopped = detok.add(token_id)
        assert not stopped
        emitted += delta
        held = held or ("STOP" in detok.text[len(emitted) :])
        assert "STOP HERE!".startswith(detok.text[len(emitted) :]) or detok.text[len(emitted) :] == ""
    assert held
    assert emitted + detok.finish() == text


def test_the_earliest_of_several_stops_wins(tokenizer: Any) -> None:
    ids = encode(tokenizer, "alpha beta gamma delta")
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, [], stop=["delta", "a gam", "beta g"]), ids)
    assert stopped and "".join(deltas) == "alpha "


def test_a_stop_inside_a_single_token(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello world")
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, [], stop=["ell"]), ids)
    assert stopped and "".join(deltas) == "H"


def test_a_stop_string_can_be_matched_on_multibyte_text(tokenizer: Any) -> None:
    ids = encode(tokenizer, MULTILINGUAL)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["🌧️"])
    deltas, stopped = stream(detok, ids)
    assert stopped and "".join(deltas) == MULTILINGUAL.split("🌧️")[0]
    assert_no_leak(deltas, detok.text)


@pytest.mark.parametrize("resume_at", [1, 4, 9, 15])
def test_a_resumed_stream_continues_where_the_first_left_off(tokenizer: Any, resume_at: int) -> None:
    """Replaying earlier tokens restores the held-back text, so the client sees the same stream."""
    ids = encode(tokenizer, "Well, 東京 STOP is near 🌞 and STOP HERE now")
    prompt = encode(tokenizer, "Tell me:")
    first = IncrementalDetokenizer(tokenizer, prompt, stop=["STOP HERE"])
    straight = [first.add(t) for t in ids]
    resumed = IncrementalDetokenizer(tokenizer, prompt, stop=["STOP HERE"], prior_output_token_ids=ids[:resume_at])
    assert [resumed.add(t) for t in ids[resume_at:]] == straight[resume_at:]
    assert resumed.text == first.text


def test_a_stop_completed_by_the_final_flush_does_not_leak(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 🌞")[:-1]  # ends inside the emoji: flushed as U+FFFD
    detok = IncrementalDetokenizer(tokenizer, [], stop=["k \ufffd"])
    deltas, stopped = stream(detok, ids)
    assert not stopped and "".join(deltas) == "o" == detok.text
