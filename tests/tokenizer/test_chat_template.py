"""The chat-template sandbox refuses resource abuse before it happens, and stops loops in time."""

from __future__ import annotations

import pytest

from tokenmill.errors import ContextLengthError, InvalidRequestError
from tokenmill.tokenizer.chat_template import (
    RenderBudgetExceeded,
    compile_chat_template,
    render_bounded,
)
from tokenmill.tokenizer.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'a' * 100000000 }}",
        "{{ 100000000 * 'a' }}",
        "{{ [1] * 100000000 }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 'x'.center(10**9) }}",
        "{{ 'x'.zfill(10**9) }}",
        "{{ ('\t' * 100).expandtabs(10**6) }}",
        "{{ 'aa'.replace('a', 'b' * 10000000) }}",
        "{{ '%999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{{ '{x:>999999999}'.format_map({'x': 1}) }}",
        "{{ 'ab' | center(10**9) }}",
        "{{ 'ab' | indent(10**9) }}",
        "{{ 'ab' | wordwrap(10**9) }}",
        "{{ 2 ** 100000000 }}",
    ],
)
def test_operations_that_would_build_huge_values_are_refused(
    byte_level_tokenizer: Tokenizer, template: str
) -> None:
    with pytest.raises(InvalidRequestError, match="chat template failed to render") as info:
        byte_level_tokenizer.apply_chat_template(MESSAGES, chat_template=template)
    assert info.value.param == "messages"


def test_ordinary_uses_of_the_same_operations_still_work() -> None:
    source = "{{ 'ab' * 2 }}|{{ 'x'.ljust(3) }}|{{ '%3d' % 7 }}|{{ '{:>3}'.format(1) }}|{{ 2 ** 10 }}|{{ 'a' | center(3) }}"
    assert (
        render_bounded(compile_chat_template(source), {}, None, None) == "abab|x  |  7|  1|1024| a "
    )


def test_output_past_the_limit_is_a_context_length_error() -> None:
    source = "{% for i in range(1000) %}0123456789{% endfor %}"
    assert len(render_bounded(compile_chat_template(source), {}, 10_000, None)) == 10_000
    with pytest.raises(ContextLengthError):
        render_bounded(compile_chat_template(source), {}, 9_999, None)


def test_a_template_that_loops_is_stopped_by_its_time_budget() -> None:
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"
    with pytest.raises(RenderBudgetExceeded, match=r"longer than 0\.2s"):
        render_bounded(compile_chat_template(source), {}, None, 0.2)
    # The tracer is gone afterwards: the same thread renders normally.
    assert render_bounded(compile_chat_template("{{ 1 + 1 }}"), {}, None, None) == "2"


def test_max_chars_per_token_bounds_every_token(byte_level_tokenizer: Tokenizer) -> None:
    bound = byte_level_tokenizer.max_chars_per_token
    assert bound is not None and bound >= 1
    backend = byte_level_tokenizer.backend
    longest = max(
        len(backend.decode([i], skip_special_tokens=False)) for i in range(backend.get_vocab_size())
    )
    assert bound == longest
    text = "the quick brown fox " * 50
    assert len(text) <= bound * len(byte_level_tokenizer.encode(text))


def test_max_chars_per_token_is_unknown_when_the_pipeline_drops_characters(
    byte_level_tokenizer: Tokenizer,
) -> None:
    from tokenizers import pre_tokenizers

    backend = byte_level_tokenizer.backend
    original = backend.pre_tokenizer
    try:
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # drops every space
        fresh = Tokenizer.__new__(Tokenizer)
        fresh._backend = backend  # type: ignore[attr-defined]
        assert fresh.max_chars_per_token is None
    finally:
        backend.pre_tokenizer = original


def test_encode_gives_the_backend_ids(byte_level_tokenizer: Tokenizer) -> None:
    text = "Hello world, <|special|> and unicode: héllo ✓"
    for add in (True, False):
        expected = byte_level_tokenizer.backend.encode(text, add_special_tokens=add).ids
        assert byte_level_tokenizer.encode(text, add_special_tokens=add) == expected
