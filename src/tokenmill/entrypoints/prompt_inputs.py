"""vLLM's prompt forms for the offline ``LLM`` API, read into text or token ids, or refused.

vLLM's ``LLM.generate``/``embed``/``encode`` take a string, a ``TextPrompt``
(``{"prompt": "..."}``), a ``TokensPrompt`` (``{"prompt_token_ids": [...]}``) or a list of
those. A dict used to be iterated as if it were a list of prompts (``{"prompt": "hello"}``
completed the word ``prompt``); here each form is read for what it is, and anything else (an
unknown key, ``multi_modal_data``, a list mixing token ids with other prompts) is a
``TypeError`` or ``ValueError`` naming what was given, raised before any request is queued.

Either dict may carry vLLM's ``cache_salt`` (a non-empty string): only prompts with the same
salt reuse each other's prefix-cache blocks.

tokenmill also takes a bare list of token ids (one prompt) and a list of such lists, the form
of vLLM's removed ``prompt_token_ids=`` argument. vLLM 0.32 refuses a bare list of ints; here
it is unambiguous (token ids are never read as text), so it stays accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.core.cache_salt import CACHE_SALT_ERROR

Prompt = str | list[int]
"""A prompt as the engine takes it: text to tokenize, or token ids."""


@dataclass(frozen=True)
class ParsedPrompt:
    """One prompt as read from any of vLLM's forms."""

    prompt: Prompt
    cache_salt: str | None = None
    """vLLM's ``cache_salt`` of a prompt dict: its prefix-cache namespace (None: the shared one)."""


PromptInput = str | list[int] | dict[str, Any]
"""One prompt in any accepted form."""

_TEXT_ONLY_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")
_NOT_BUILT_KEYS = ("prompt_embeds", "token_type_ids")


def parse_prompts(prompts: PromptInput | Sequence[PromptInput], api: str) -> list[ParsedPrompt]:
    """Every prompt ``prompts`` holds, in order; ``api`` (``LLM.generate``) names the caller
    in errors."""
    if isinstance(prompts, str | dict):
        return [_parse_one(prompts, api)]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"{api}: prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', "
            f"a list of token ids, or a list of those; got {type(prompts).__name__}"
        )
    items: list[Any] = list(prompts)
    if items and all(_is_token_id(t) for t in items):
        return [ParsedPrompt([int(t) for t in items])]
    if any(_is_token_id(t) for t in items):
        kinds = sorted({type(t).__name__ for t in items})
        raise TypeError(
            f"{api}: a list mixing token ids with other prompts ({', '.join(kinds)}); give one "
            "prompt's token ids as a list of ints, or several prompts as a list of prompts"
        )
    return [_parse_one(item, api, index) for index, item in enumerate(items)]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_one(item: Any, api: str, index: int | None = None) -> ParsedPrompt:
    where = f"{api}: prompt {index}" if index is not None else f"{api}: the prompt"
    if isinstance(item, str):
        return ParsedPrompt(item)
    if isinstance(item, list | tuple):
        return ParsedPrompt(_token_ids(item, where))
    if not isinstance(item, dict):
        raise TypeError(
            f"{where} is a {type(item).__name__}; expected a string, a list of token ids, or a "
            "dict with 'prompt' or 'prompt_token_ids'"
        )
    keys = set(item)
    for key in _TEXT_ONLY_KEYS:
        if key in keys:
            raise ValueError(f"{where} has {key!r}: tokenmill serves text-only models")
    for key in _NOT_BUILT_KEYS:
        if key in keys:
            raise ValueError(f"{where} has {key!r}, which the LLM API does not take")
    unknown = sorted(keys - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {unknown}; a prompt dict holds 'prompt' (text) or "
            "'prompt_token_ids' (token ids), and optionally 'cache_salt'"
        )
    salt = _cache_salt(item, where)
    keys.discard("cache_salt")
    if keys == {"prompt"}:
        if not isinstance(item["prompt"], str):
            raise TypeError(
                f"{where}: 'prompt' must be a string, got {type(item['prompt']).__name__}"
            )
        return ParsedPrompt(item["prompt"], salt)
    if keys == {"prompt_token_ids"}:
        ids = _token_ids(item["prompt_token_ids"], f"{where}: 'prompt_token_ids'")
        return ParsedPrompt(ids, salt)
    raise ValueError(
        f"{where} has keys {sorted(item)}; give exactly one of 'prompt' or 'prompt_token_ids'"
    )


def _cache_salt(item: dict[str, Any], where: str) -> str | None:
    """The dict's ``cache_salt``: absent, or a non-empty string (vLLM's rule and message)."""
    if "cache_salt" not in item or item["cache_salt"] is None:
        return None
    salt = item["cache_salt"]
    if not isinstance(salt, str):
        raise TypeError(f"{where}: {CACHE_SALT_ERROR} Got {type(salt).__name__}")
    if not salt:
        raise ValueError(f"{where}: {CACHE_SALT_ERROR}")
    return salt


def _token_ids(value: Any, where: str) -> list[int]:
    if not isinstance(value, list | tuple) or not all(_is_token_id(t) for t in value):
        raise TypeError(f"{where} must be a list of ints (token ids), got {_shown(value)}")
    return [int(t) for t in value]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
