"""--chat-template (file or inline) and --chat-template-content-format, resolved at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.entrypoints.openai.chat_options import (
    ChatOptions,
    detect_content_format,
    format_content,
    resolve_chat_template,
)
from tokenmill.errors import ConfigError
from tokenmill.model.demo import demo_model_path
from tokenmill.tokenizer.tokenizer import Tokenizer


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert resolve_chat_template("{{ bos_token }}hi") == "{{ bos_token }}hi"
    assert resolve_chat_template(None) is None
    with pytest.raises(ConfigError, match="no such file, and it is not a template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


def test_auto_content_format_reads_the_template() -> None:
    assert detect_content_format("{{ m['content'] }}") == "string"
    assert detect_content_format("{% for p in message['content'] %}{{ p.text }}{% endfor %}") == (
        "openai"
    )
    demo = Tokenizer.from_pretrained(demo_model_path()).chat_template
    assert detect_content_format(demo) == "openai"  # it loops over content parts
    assert ChatOptions(content_format="string").content_format_for(demo) == "string"


def test_string_format_joins_text_parts_and_openai_keeps_them() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    message = {"role": "user", "content": parts}
    assert format_content(message, "string")["content"] == "a\nb"
    assert format_content(message, "openai")["content"] == parts
    assert format_content({"role": "user", "content": "s"}, "openai")["content"] == "s"
