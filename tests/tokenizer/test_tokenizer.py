"""Tokenizer: loading, encode/decode and chat rendering must match transformers exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer.chat_template import compile_chat_template

transformers = pytest.importorskip("transformers")

STYLES = ["byte_level", "sentencepiece"]

PARITY_TEXTS = [
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand  double  spaces",
    "Ünïcödé: café, naïve, résumé, façade",
    "中文字符和日本語のテキスト、한국어",
    "emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "combining e\u0301 and zero\u200bwidth",
    "<s>special</s> tokens <|im_start|>user\nhi<|im_end|>",
    "almost special <|im_start and </s >",
    "numbers 1234567890 3.14159 -42 1e-5",
    "def f(x):\n    return {'a': [1, 2, 3]}\n",
    "a" * 300,
    "\ufffd replacement char and \x00 nul",
]

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And  3+3?\n"},
    ],
    [{"role": "user", "content": "unicode 世界 🎉 and <s> inside"}],
]


def folder_of(style: str, request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{style}_dir")


@pytest.fixture(scope="session")
def hf_tokenizers(byte_level_dir: Path, sentencepiece_dir: Path) -> dict[str, Any]:
    auto = transformers.AutoTokenizer
    return {
        "byte_level": auto.from_pretrained(str(byte_level_dir)),
        "sentencepiece": auto.from_pretrained(str(sentencepiece_dir)),
    }


@pytest.fixture(scope="session")
def ours(
    byte_level_tokenizer: Tokenizer, sentencepiece_tokenizer: Tokenizer
) -> dict[str, Tokenizer]:
    return {"byte_level": byte_level_tokenizer, "sentencepiece": sentencepiece_tokenizer}


def write_variant(src: Path, dst: Path, **config_changes: Any) -> Path:
    """Copy a tokenizer folder, changing tokenizer_config keys (None deletes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


# ---------------------------------------------------------------- encode / decode parity


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_encode_matches_transformers(style: str, text: str, ours, hf_tokenizers) -> None:
    tok, hf = ours[style], hf_tokenizers[style]
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("style", STYLES)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=80))
def test_encode_matches_transformers_on_random_text(
    style: str, text: str, ours, hf_tokenizers
) -> None:
    assert ours[style].encode(text) == hf_tokenizers[style].encode(text)


@pytest.mark.parametrize("style", STYLES)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_decode_matches_transformers(style: str, data: st.DataObject, ours, hf_tokenizers) -> None:
    tok, hf = ours[style], hf_tokenizers[style]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("style", STYLES)
def test_vocab_and_special_ids_match_transformers(style: str, ours, hf_tokenizers) -> None:
    tok, hf = ours[style], hf_tokenizers[style]
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_id == hf.eos_token_id
    # transformers lists only named special tokens; ours also has every added special token.
    assert set(hf.all_special_ids) <= tok.all_special_ids
    ids = list(range(tok.vocab_size))
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_demo_tokenizer_attributes(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.all_special_ids == {0, 1, 2, 3}
    assert tok.has_chat_template
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id
    assert tok.convert_ids_to_tokens(0) == "<s>"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens(tok.vocab_size + 5)


def test_decode_skips_special_tokens_by_default(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert tok.decode(ids) == "user\nhello world"
    assert (
        tok.decode(ids, skip_special_tokens=False) == "<s><|im_start|>user\nhello world<|im_end|>"
    )


def test_id_to_token_text_byte_level(byte_level_tokenizer: Tokenizer) -> None:
    tok = byte_level_tokenizer
    for token_id in range(tok.vocab_size):
        assert tok.id_to_token_text(token_id) == tok.decode([token_id], skip_special_tokens=False)
    (the,) = tok.encode(" the", add_special_tokens=False)
    assert tok.id_to_token_text(the) == " the"


def test_id_to_token_text_keeps_sentencepiece_spaces(sentencepiece_tokenizer: Tokenizer) -> None:
    tok = sentencepiece_tokenizer
    ids = tok.encode("the quick fox", add_special_tokens=False)
    pieces = [tok.id_to_token_text(i) for i in ids]
    # Decoding alone would strip the leading space of " quick"; in context it stays.
    assert "".join(pieces) == " the quick fox"
    assert tok.decode(ids) == "the quick fox"
    assert tok.id_to_token_text(tok.eos_token_id) == "</s>"


# ---------------------------------------------------------------- config handling


@pytest.mark.parametrize("style", STYLES)
def test_add_bos_eos_flags_do_not_override_tokenizer_json(
    style: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """transformers v5 ignores these flags when tokenizer.json exists; so must we."""
    src = folder_of(style, request)
    folder = write_variant(src, tmp_path / "flags", add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok.encode("hello there")
    assert ids == hf.encode("hello there")
    assert ids[0] == tok.bos_token_id and ids[-1] != tok.eos_token_id


def test_config_tokens_missing_from_vocab_are_added(tmp_path: Path, byte_level_dir: Path) -> None:
    folder = write_variant(
        byte_level_dir,
        tmp_path / "pad",
        pad_token={"__type": "AddedToken", "content": "<pad>", "special": True},
        additional_special_tokens=["<tool>"],
    )
    tok = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.vocab_size == len(hf)
    assert tok.pad_token_id == hf.pad_token_id is not None
    text = "a<pad>b<tool>c"
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(tok.encode(text)) == "abc"


def test_missing_tokenizer_json_names_folder_and_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "tokenizer.json" in str(info.value)


def test_corrupt_tokenizer_config_is_a_load_error(tmp_path: Path, byte_level_dir: Path) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(byte_level_dir, folder)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_pretrained(folder)


def test_tokenizer_config_is_optional(tmp_path: Path, byte_level_dir: Path) -> None:
    shutil.copy(byte_level_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.bos_token_id is None and tok.eos_token_id is None
    assert not tok.has_chat_template
    assert tok.encode("hi")[0] == 0  # tokenizer.json's own post-processor adds <s>


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("chat_index", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    style: str, chat_index: int, add_generation_prompt: bool, ours, hf_tokenizers
) -> None:
    messages = CHATS[chat_index]
    if style == "sentencepiece" and messages[-1]["role"] != "user":
        pytest.skip("the Llama-2 template needs alternating roles ending with user")
    expected = hf_tokenizers[style].apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours[style].apply_chat_template(messages, add_generation_prompt) == expected


RICH_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{{ bos_token }}
{%- if tools %}
Tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
  {% set ns.count = ns.count + 1 %}
  {% if message.role == 'assistant' %}
{% generation %}A{{ ns.count }}: {{ message.content | trim }}{% endgeneration %}{{ eos_token }}
  {% else %}
{{ message.role | upper }}{{ ns.count }}: {{ message.content }}
    {% if message.reasoning_content is defined %}[{{ message.reasoning_content }}]{% endif %}
  {% endif %}
  {% if loop.last and add_generation_prompt %}A:{% endif %}
  {% if message.content == 'stop' %}{% break %}{% endif %}
{% endfor %}
{{ custom_flag | default('none') }}{{ '%Y' | length }}"""


@pytest.mark.parametrize("style", STYLES)
def test_rich_template_matches_transformers(style: str, ours, hf_tokenizers) -> None:
    """namespace, tojson (no HTML escaping), trim/lstrip blocks, loop controls, {% generation %}."""
    messages = [
        {"role": "system", "content": "<b>bold</b> & 'quotes'", "name": None},
        {"role": "user", "content": "hi", "reasoning": "thinking aloud"},
        {"role": "assistant", "content": "  hello  "},
        {"role": "user", "content": "stop"},
        {"role": "user", "content": "never rendered"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "<x> & é"}}]
    expected = hf_tokenizers[style].apply_chat_template(
        messages,
        tools=tools,
        chat_template=RICH_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        custom_flag="on",
    )
    got = ours[style].apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, tools=tools, custom_flag="on"
    )
    assert got == expected
    assert "<x> & é" in got and "never rendered" not in got


def test_chat_template_jinja_file_wins(tmp_path: Path, byte_level_dir: Path) -> None:
    folder = write_variant(byte_level_dir, tmp_path / "jinja")
    (folder / "chat_template.jinja").write_text(
        "FILE{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tok = Tokenizer.from_pretrained(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "FILEx"
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "FILEx"


def test_named_chat_templates(tmp_path: Path, byte_level_dir: Path) -> None:
    templates = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "rag", "template": "R{{ documents | length }}"},
    ]
    folder = write_variant(byte_level_dir, tmp_path / "named", chat_template=templates)
    tok = Tokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "Dx"
    assert tok.apply_chat_template(messages, tools=[{"a": 1}, {"b": 2}]) == "T2"
    assert tok.apply_chat_template(messages, chat_template="rag", documents=[{}]) == "R1"

    no_default = write_variant(byte_level_dir, tmp_path / "nodefault", chat_template=templates[1:])
    with pytest.raises(InvalidRequestError, match="none is named 'default'"):
        Tokenizer.from_pretrained(no_default).apply_chat_template(messages)


def test_no_chat_template_is_a_clear_error(tmp_path: Path, byte_level_dir: Path) -> None:
    folder = write_variant(byte_level_dir, tmp_path / "none", chat_template=None)
    tok = Tokenizer.from_pretrained(folder)
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="has no chat template") as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # It says what to do about it: the flag, the request field, or the completions route.
    assert "--chat-template" in str(info.value) and "/v1/completions" in str(info.value)
    assert str(folder) not in str(info.value)  # no server paths in a client's error


def test_broken_template_syntax_is_invalid_request(byte_level_tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="chat template is invalid") as info:
        byte_level_tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template="{% for m in messages %}{{ m"
        )
    assert info.value.param == "chat_template"


def test_raise_exception_in_template_is_invalid_request(sentencepiece_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidRequestError, match="roles must alternate") as info:
        sentencepiece_tokenizer.apply_chat_template(messages)
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content + 1 }}",  # TypeError
        "{{ messages[5].content.upper() }}",  # undefined attribute call
        "{{ ''.__class__.__mro__ }}",  # sandbox violation
        "{{ 1 // 0 }}",
    ],
)
def test_template_runtime_errors_are_invalid_request(
    template: str, byte_level_tokenizer: Tokenizer
) -> None:
    with pytest.raises(InvalidRequestError, match="chat template"):
        byte_level_tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], chat_template=template
        )


def test_empty_messages_rejected(byte_level_tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="at least one message"):
        byte_level_tokenizer.apply_chat_template([])


def test_template_helpers(byte_level_tokenizer: Tokenizer) -> None:
    template = "{{ strftime_now('%Y') | length }}|{{ bos_token }}|{{ eos_token }}|{{ extra }}"
    got = byte_level_tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], chat_template=template, extra=7
    )
    assert got == "4|<s>|</s>|7"


def test_content_parts_render_as_text(byte_level_tokenizer: Tokenizer, hf_tokenizers) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    got = byte_level_tokenizer.apply_chat_template(messages)
    assert got == "<s><|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    expected = hf_tokenizers["byte_level"].apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert got == expected


def test_template_compilation_is_cached() -> None:
    source = "{{ messages | length }} cached-template-test"
    assert compile_chat_template(source) is compile_chat_template(source)


def test_rendered_chat_encodes_like_transformers(
    byte_level_tokenizer: Tokenizer, hf_tokenizers
) -> None:
    hf = hf_tokenizers["byte_level"]
    messages = CHATS[1]
    prompt = byte_level_tokenizer.apply_chat_template(messages)
    expected_ids = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert byte_level_tokenizer.encode(prompt, add_special_tokens=False) == expected_ids
