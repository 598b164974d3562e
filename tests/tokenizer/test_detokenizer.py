"""IncrementalDetokenizer: streamed deltas must add up to a full decode, never broken UTF-8."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

STYLES = ["byte_level", "sentencepiece"]

# Pieces that split into several byte tokens: accents, CJK, emoji, ZWJ sequences, flags.
UNICODE_PIECES = [
    " héllo",
    "世界",
    "日本語",
    " 🎉",
    "🚀🚀",
    "👩‍👩‍👧‍👦",
    "🇫🇷",
    "naïve café",
    "\n\n",
    "  spaced  ",
    " the quick fox",
    "é",
    "ℕ≠∅",
]

FUZZ_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def tokenizer_of(style: str, request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(f"{style}_tokenizer")


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int]
) -> list[str]:
    """Feed ``ids`` in chunks (sizes cycle), return every delta including finish()."""
    deltas: list[str] = []
    position, step = 0, 0
    while position < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)] if chunk_sizes else 1
        deltas.append(detok.add_tokens(ids[position : position + size]))
        position += size
        step += 1
    deltas.append(detok.finish())
    return deltas


@st.composite
def token_sequences(draw: st.DrawFn, tokenizer: Tokenizer) -> list[int]:
    """Random ids mixed with encodings of multi-byte text and special tokens."""
    special = sorted(tokenizer.all_special_ids)
    parts = draw(
        st.lists(
            st.one_of(
                st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=4),
                st.sampled_from(UNICODE_PIECES).map(
                    lambda text: tokenizer.encode(text, add_special_tokens=False)
                ),
                st.sampled_from(special).map(lambda token_id: [token_id]),
            ),
            max_size=12,
        )
    )
    return [token_id for part in parts for token_id in part]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@FUZZ_SETTINGS
@given(data=st.data())
def test_deltas_add_up_to_full_decode(
    style: str, skip_special_tokens: bool, data: st.DataObject, request: pytest.FixtureRequest
) -> None:
    tokenizer = tokenizer_of(style, request)
    ids = data.draw(token_sequences(tokenizer), label="ids")
    chunk_sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6), label="chunks")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, chunk_sizes)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detok.text == expected
    assert detok.token_ids == ids
    # Held-back text only ever comes out whole: no streamed delta ends mid-character.
    assert not any(delta.endswith("\ufffd") for delta in deltas[:-1])


@pytest.mark.parametrize("style", STYLES)
@FUZZ_SETTINGS
@given(
    pieces=st.lists(st.sampled_from(UNICODE_PIECES), min_size=1, max_size=8),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_valid_text_streams_without_replacement_chars(
    style: str, pieces: list[str], chunk_sizes: list[int], request: pytest.FixtureRequest
) -> None:
    tokenizer = tokenizer_of(style, request)
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids, chunk_sizes)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_emoji_is_held_until_complete(byte_level_tokenizer: Tokenizer) -> None:
    tokenizer = byte_level_tokenizer
    ids = tokenizer.encode("a🎉", add_special_tokens=False)
    assert len(ids) >= 3  # "a" plus several byte pieces of the emoji
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens(ids[:1]) == "a"
    for token_id in ids[1:-1]:
        assert detok.add_tokens([token_id]) == ""
    assert detok.add_tokens(ids[-1:]) == "🎉"
    assert detok.finish() == ""


def test_finish_flushes_an_incomplete_character(byte_level_tokenizer: Tokenizer) -> None:
    tokenizer = byte_level_tokenizer
    ids = tokenizer.encode("ok 世", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detok.add_tokens([token_id]) for token_id in ids)
    assert "\ufffd" not in streamed
    rest = detok.finish()
    assert rest.endswith("\ufffd")
    assert streamed + rest == tokenizer.decode(ids)
    assert detok.finish() == ""  # idempotent
    with pytest.raises(RuntimeError):
        detok.add_tokens([1])


def test_sentencepiece_spaces_survive_windowing(sentencepiece_tokenizer: Tokenizer) -> None:
    """The decoder strips a sequence's leading space; decoding in context must not."""
    tokenizer = sentencepiece_tokenizer
    text = "The river ran quietly through the valley, past fields of wheat."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens([token_id]) for token_id in ids]
    assert "".join(deltas) + detok.finish() == text
    assert any(delta.startswith(" ") for delta in deltas[1:])


def test_prompt_context_keeps_first_generated_space(sentencepiece_tokenizer: Tokenizer) -> None:
    tokenizer = sentencepiece_tokenizer
    prompt_ids = tokenizer.encode("Once upon a time")
    all_ids = tokenizer.encode("Once upon a time there lived a dragon")
    assert all_ids[: len(prompt_ids)] == prompt_ids
    generated = all_ids[len(prompt_ids) :]
    without_context = IncrementalDetokenizer(tokenizer)
    with_context = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    assert "".join(stream(without_context, generated, [1])) == tokenizer.decode(generated)
    text = "".join(stream(with_context, generated, [1]))
    full = tokenizer.decode(prompt_ids + generated)
    assert text == full[len(tokenizer.decode(prompt_ids)) :]
    assert text == " there lived a dragon"
    assert tokenizer.decode(generated) == "there lived a dragon"  # what context fixes
    assert with_context.token_ids == generated


class RecordingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call saw."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []
        self.byte_fallback_ids = inner.byte_fallback_ids
        self.all_special_ids = inner.all_special_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("style", STYLES)
def test_cost_per_token_is_bounded_by_a_window(style: str, request: pytest.FixtureRequest) -> None:
    tokenizer = tokenizer_of(style, request)
    ids = tokenizer.encode("Streaming 世界 🎉 text. " * 60, add_special_tokens=False)
    assert len(ids) > 500
    recorder = RecordingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(recorder, skip_special_tokens=True)  # type: ignore[arg-type]
    streamed = "".join(detok.add_tokens([token_id]) for token_id in ids)
    assert max(recorder.decode_lengths) <= 16
    assert streamed + detok.finish() == tokenizer.decode(ids)


class DriftingTokenizer:
    """Decodes id i as "w{i} ", plus "!" when ids 1 and 2 are both decoded together.

    Windows never hold both once they are far apart, so only a full decode has the "!":
    the drift cleanup rules can cause in real tokenizers.
    """

    byte_fallback_ids: frozenset[int] = frozenset()
    all_special_ids: frozenset[int] = frozenset()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = "".join(f"w{i} " for i in ids)
        return text + "!" if 1 in ids and 2 in ids else text


def test_finish_repairs_drift_from_full_decode() -> None:
    detok = IncrementalDetokenizer(DriftingTokenizer())  # type: ignore[arg-type]
    ids = [1, 5, 6, 7, 8, 2]
    streamed = "".join(detok.add_tokens([token_id]) for token_id in ids)
    assert streamed == "w1 w5 w6 w7 w8 w2 "
    assert detok.finish() == "!"
    assert detok.text == DriftingTokenizer().decode(ids)


def test_empty_input() -> None:
    detok = IncrementalDetokenizer(DriftingTokenizer())  # type: ignore[arg-type]
    assert detok.add_tokens([]) == ""
    assert detok.finish() == ""
    assert detok.text == "" and detok.is_finished
