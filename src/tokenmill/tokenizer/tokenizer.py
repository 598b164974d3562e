"""Text <-> token ids for a Hugging Face model folder, and chat prompt rendering.

Owns reading ``tokenizer.json``, ``tokenizer_config.json`` and the chat template files the
way ``transformers.AutoTokenizer`` does, so prompts get exactly the ids the model was
trained with, using only the ``tokenizers`` library. Chat templates are untrusted Jinja
from the Hub, so they run in a sandbox and every failure becomes an ``InvalidRequestError``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.tokenizer.chat_template import compile_chat_template, render_bounded

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens transformers exposes to chat templates, in its order.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names a message's reasoning may come under; templates read the first (or "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
    """A model's tokenizer: encode, decode and chat template rendering."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str = "",
    ) -> None:
        self._backend = backend
        # Template context and named ids, e.g. {"bos_token": "<s>", "eos_token": "</s>"}.
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        # Chat templates by name; the one used by default is "default".
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.name_or_path = name_or_path
        self._is_bpe = type(backend.model).__name__ == "BPE"
        self._token_text_cache: dict[int, str] = {}
        self._anchor_id = self._find_anchor_id()

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder."""
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"model folder {str(folder)!r} has no {TOKENIZER_FILE}; tokenmill needs the "
                "fast-tokenizer file (re-save the tokenizer with transformers to create it)"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ModelLoadError(f"could not parse {tokenizer_file}: {exc}") from exc
        config = _read_json(folder / TOKENIZER_CONFIG_FILE)
        # transformers controls length and batching per call; file defaults would truncate prompts.
        backend.no_truncation()
        backend.no_padding()

        special_tokens = _special_tokens_from_config(config)
        _add_missing_tokens(backend, config, special_tokens)
        # add_bos_token/add_eos_token are ignored on purpose: transformers v5 drops them when
        # tokenizer.json exists, whose post-processor alone decides BOS/EOS.
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_templates=_read_chat_templates(folder, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            name_or_path=str(folder),
        )

    # --------------------------------------------------------------- properties

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the model has one."""
        return self._named_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, if the model has one."""
        return self._named_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, if the model has one."""
        return self._named_token_id("pad_token")

    @functools.cached_property
    def all_special_ids(self) -> set[int]:
        """Ids of every special token: named ones and added tokens marked special."""
        ids = {i for i, token in self._backend.get_added_tokens_decoder().items() if token.special}
        for name in NAMED_SPECIAL_TOKENS:
            token_id = self._named_token_id(name)
            if token_id is not None:
                ids.add(token_id)
        return ids

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of "<0xNN>" byte tokens, if the decoder has ByteFallback (Llama 2, Mistral).

        That decoder turns a whole run of byte tokens into U+FFFDs when any byte in it is
        invalid, so streaming must wait for such a run to end.
        """
        decoder = self._backend.decoder
        if decoder is None or b'"ByteFallback"' not in decoder.__getstate__():
            return frozenset()
        ids = (self._backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
        return frozenset(i for i in ids if i is not None)

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(self.chat_templates)

    @property
    def chat_template(self) -> str | None:
        """Source of the default chat template, if any."""
        return self.chat_templates.get("default")

    # ---------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens in the text become their ids.

        Goes through ``encode_batch``, which releases the GIL while it works (``encode``
        holds it), so a long prompt tokenized on a worker thread does not stall the server.
        """
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most input characters one token can stand for, or None when unknown.

        With it, a text longer than ``max_tokens * max_chars_per_token`` characters is known
        to need more than ``max_tokens`` tokens without tokenizing it. It is only sound when
        the normalizer and pre-tokenizer never delete or merge characters; for any other
        pipeline (whitespace splitting, stripping, NFKC, ...) it is None.
        """
        pipeline = json.loads(self._backend.to_str())
        if not (
            _keeps_characters(pipeline.get("normalizer"))
            and _keeps_characters(pipeline.get("pre_tokenizer"))
        ):
            return None
        size = self._backend.get_vocab_size(with_added_tokens=True)
        texts = self._backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return max(1, *(len(t) for t in texts))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, as transformers' ``decode`` returns it."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        # transformers skips this WordPiece-era cleanup for BPE because it corrupts text.
        if self.clean_up_tokenization_spaces and not self._is_bpe:
            text = clean_up_tokenization(text)
        return text

    def id_to_token_text(self, token_id: int) -> str:
        """Text one token adds after ordinary text, e.g. " the" (for logprob display).

        Decoding the token alone would lose a leading space in SentencePiece-style
        tokenizers, so it is decoded after a plain anchor token and the anchor is cut off.
        """
        cached = self._token_text_cache.get(token_id)
        if cached is not None:
            return cached
        if self._anchor_id is None:
            text = self._backend.decode([token_id], skip_special_tokens=False)
        else:
            anchor = self._backend.decode([self._anchor_id], skip_special_tokens=False)
            both = self._backend.decode([self._anchor_id, token_id], skip_special_tokens=False)
            text = both[len(anchor) :] if both.startswith(anchor) else both
        self._token_text_cache[token_id] = text
        return text

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        """Vocabulary strings of ``ids`` (e.g. "Ġthe"), one per id."""
        if isinstance(ids, int):
            return self._id_to_token(ids)
        return [self._id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    # ------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        max_chars: int | None = None,
        time_budget_s: float | None = None,
        **extra_context: Any,
    ) -> str:
        """Render a conversation to a prompt string with the model's chat template.

        ``chat_template`` may be a template name or a template source; ``extra_context``
        (e.g. ``tools``) is passed to the template. Encode the result with
        ``add_special_tokens=False``: templates write their own BOS. A render longer than
        ``max_chars`` or slower than ``time_budget_s`` is stopped (see ``render_bounded``).
        """
        source = self._select_chat_template(
            chat_template, has_tools=bool(extra_context.get("tools"))
        )
        if not messages:
            raise InvalidRequestError(
                "messages must contain at least one message", param="messages"
            )
        template = compile_chat_template(source)
        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update(self.special_tokens)
        context.update(extra_context)
        context["messages"] = _normalize_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return render_bounded(template, context, max_chars, time_budget_s)
        except InvalidRequestError:
            raise
        except Exception as exc:  # the template is untrusted code; any failure is the request's
            raise InvalidRequestError(
                f"chat template failed to render: {type(exc).__name__}: {exc}", param="messages"
            ) from exc

    # ------------------------------------------------------------ helpers

    def _select_chat_template(self, chat_template: str | None, has_tools: bool) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if not self.chat_templates:
            raise InvalidRequestError(
                "the model has no chat template (a base model?), so it cannot format chat "
                "messages: start the server with --chat-template (a Jinja template file or "
                "string, as in vLLM), send a `chat_template` with the request, or use "
                "/v1/completions with a plain prompt",
                param="messages",
            )
        if has_tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise InvalidRequestError(
            f"the model has several chat templates and none is named 'default': "
            f"{sorted(self.chat_templates)}; pass one by name",
            param="chat_template",
        )

    def _named_token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def _id_to_token(self, token_id: int) -> str:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise InvalidRequestError(
                f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
            )
        return token

    def _find_anchor_id(self) -> int | None:
        """A plain single-letter token whose decoding does not merge with what follows."""
        for candidate in ("a", "x", "the"):
            token_id = self._backend.encode(candidate, add_special_tokens=False).ids
            if len(token_id) == 1 and token_id[0] not in self.all_special_ids:
                decoded = self._backend.decode(token_id, skip_special_tokens=False)
                if decoded == candidate:
                    return token_id[0]
        return None


_CHARACTER_KEEPING_STEPS = frozenset(
    {"Lowercase", "Prepend", "NFD", "ByteLevel", "Metaspace", "Digits", "Punctuation"}
)
"""Normalizer and pre-tokenizer steps that never delete or merge input characters."""


def _keeps_characters(step: Mapping[str, Any] | None) -> bool:
    """True when a normalizer or pre-tokenizer (as tokenizer.json has it) keeps every character."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        parts = step.get("normalizers") or step.get("pretokenizers") or []
        return all(_keeps_characters(part) for part in parts)
    if kind == "Replace":  # e.g. " " -> "▁": fine unless the replacement is shorter
        pattern = step.get("pattern", {})
        return "String" in pattern and len(step.get("content", "")) >= len(pattern["String"])
    if kind == "Split":
        return step.get("behavior") != "Removed"
    return kind in _CHARACTER_KEEPING_STEPS


# ------------------------------------------------------------------ config reading


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A token from a config: a string, or a serialized AddedToken with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens_from_config(config: Mapping[str, Any]) -> dict[str, str]:
    """Named tokens (``bos_token``...) plus model-specific ``*_token`` strings."""
    tokens: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token"):
            content = _token_content(value)
            if content is not None:
                tokens[key] = content
    return tokens


def _added_token(value: Any, *, special: bool) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", not special)),
            special=bool(value.get("special", special)),
        )
    return None


def _add_missing_tokens(
    backend: BackendTokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, str]
) -> None:
    """Register config tokens that are not added tokens yet, in transformers' order.

    Tokens already in the base vocabulary are registered too, as transformers does, so
    they match as whole pieces and are skipped when decoding without special tokens.
    """
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    to_add: list[AddedToken] = []

    def consider(token: AddedToken | None) -> None:
        if token is not None and token.content not in known:
            known.add(token.content)
            to_add.append(token)

    decoder = config.get("added_tokens_decoder") or {}
    if isinstance(decoder, Mapping):
        for _, value in sorted(decoder.items(), key=lambda item: int(item[0])):
            consider(_added_token(value, special=True))
    for content in special_tokens.values():
        consider(AddedToken(content, special=True, normalized=False))
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, list):
            for value in extra:
                consider(_added_token(value, special=True))
    if to_add:
        backend.add_tokens(to_add)


def _read_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name; ``chat_template.jinja`` files win over tokenizer_config's."""
    templates: dict[str, str] = {}
    jinja_file = folder / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = folder / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, Mapping) and "name" in entry and "template" in entry:
                templates[str(entry["name"])] = str(entry["template"])
    return templates


def clean_up_tokenization(text: str) -> str:
    """transformers' removal of spaces before punctuation and contractions."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


# ------------------------------------------------------------------ chat templates


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys and alias reasoning fields, as transformers does."""
    normalized: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{index}] must be an object, got {type(message).__name__}",
                param="messages",
            )
        clean = {key: value for key, value in message.items() if value is not None}
        reasoning = next((clean[key] for key in _REASONING_FIELDS if key in clean), None)
        if reasoning is not None:
            clean = {"thinking": reasoning, **clean, "reasoning_content": reasoning}
        normalized.append(clean)
    return normalized
