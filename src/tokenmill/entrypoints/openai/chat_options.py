"""The operator's chat settings, resolved once at start-up: vLLM's chat flags.

``--chat-template`` is a file or the template itself (vLLM's rule: a path that opens is a
file; otherwise text with template markup is the template; anything else is a path that
does not exist). ``--chat-template-content-format`` decides whether a message's content
reaches the template as one string or as OpenAI's list of parts; ``auto`` reads the
template, as vLLM does, and picks ``openai`` when it loops over or indexes ``content``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import ConfigError

_TEMPLATE_MARKUP = re.compile(r"[{}\n]")
_CONTENT_AS_LIST = re.compile(
    r"for\s+\w+\s+in\s+[\w.\[\]'\"]*content|content\s*\[\s*\d|content\s*\|\s*(?:selectattr|map)"
    r"|content\s+is\s+(?:not\s+)?(?:string|iterable|sequence)|content\[['\"]type['\"]\]"
)
"""Template code that reads ``content`` as a list of parts (vLLM's openai format)."""


def resolve_chat_template(value: str | None) -> str | None:
    """The template source ``--chat-template`` names (None: the model's own)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a name too long to be a path is template text
        pass
    if _TEMPLATE_MARKUP.search(value):
        return value
    raise ConfigError(
        f"--chat-template {value!r}: no such file, and it is not a template either "
        "(give a template file or the template text itself)"
    )


def detect_content_format(template: str | None) -> str:
    """``openai`` when the template reads ``content`` as a list of parts, else ``string``."""
    if template is not None and _CONTENT_AS_LIST.search(template):
        return "openai"
    return "string"


def format_content(message: dict[str, Any], content_format: str) -> dict[str, Any]:
    """A message with its content shaped for the template: a list of text parts joined into
    one string (``string``), or kept as it came (``openai``; a string stays a string, so a
    template renders what transformers' ``apply_chat_template`` would)."""
    content = message.get("content")
    if content_format == "string" and isinstance(content, list):
        text = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
        return {**message, "content": text}
    return message


@dataclass(frozen=True)
class ChatOptions:
    """What the chat endpoint takes from the command line rather than the request."""

    template: str | None = None
    """``--chat-template``'s source; None: the model's own."""
    content_format: str = "auto"
    """``string``, ``openai`` or ``auto`` (resolved per template in ``content_format_for``)."""
    default_kwargs: dict[str, Any] | None = None
    """``--default-chat-template-kwargs``: template variables every request gets."""
    response_role: str = "assistant"
    """The role of responses to requests that add the generation prompt."""

    def content_format_for(self, template: str | None) -> str:
        """The content format for rendering with ``template`` (the source used)."""
        if self.content_format != "auto":
            return self.content_format
        return detect_content_format(template)
