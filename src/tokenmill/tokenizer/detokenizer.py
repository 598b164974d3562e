"""Streaming detokenization: turn generated token ids into text deltas as they arrive.

Owns the prefix_offset/read_offset technique (as in vLLM and TGI): each step decodes only a
short window of recent tokens twice, with and without the new ones, and emits the
difference. Decoding in context keeps the spaces that SentencePiece-style decoders strip
from a sequence's first token. Text is held back while it ends in U+FFFD (a multi-byte
character split across byte-level tokens) or in a ByteFallback byte token (whose whole
run decodes as U+FFFDs if a later byte turns out invalid), so nothing broken is streamed.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.tokenizer.tokenizer import Tokenizer

# The replacement character a byte-level decoder emits for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as decoding context for the first generated tokens (vLLM uses 5).
NUM_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one generated sequence, fed token ids as they are sampled.

    The deltas, ``finish()`` included, add up to ``tokenizer.decode(ids)`` of all ids fed
    (with ``prompt_ids``: the text those ids add after the prompt's last tokens).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-NUM_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._num_context_tokens = len(context)
        # Context ids followed by every generated id.
        self._ids: list[int] = context
        # Window start: tokens before it are never decoded again.
        self._prefix_offset = 0
        # Tokens before it have had their text emitted.
        self._read_offset = len(context)
        self._text = ""
        self._is_finished = False
        self._byte_fallback_ids = tokenizer.byte_fallback_ids
        self._special_ids = tokenizer.all_special_ids

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        """Every generated id fed so far (prompt context excluded)."""
        return self._ids[self._num_context_tokens :]

    @property
    def is_finished(self) -> bool:
        """Whether ``finish()`` has been called."""
        return self._is_finished

    def add_tokens(self, ids: Sequence[int]) -> str:
        """Feed newly generated ids; return the text they complete (maybe empty)."""
        if self._is_finished:
            raise RuntimeError("add_tokens() called after finish()")
        if not ids:
            return ""
        self._ids.extend(ids)
        if self._ends_in_byte_run():
            return ""
        prefix_text, new_text = self._decode_window()
        # Text ending in U+FFFD may be a multi-byte character whose last bytes are still to come.
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back; call once when the sequence ends."""
        if self._is_finished:
            return ""
        self._is_finished = True
        full_text = self._decode_all()
        if full_text is not None and full_text.startswith(self._text):
            # Also repairs the rare case where windowed decoding drifted from a full decode.
            rest = full_text[len(self._text) :]
        else:
            prefix_text, new_text = self._decode_window()
            rest = new_text[len(prefix_text) :]
        self._read_offset = self._prefix_offset = len(self._ids)
        self._text += rest
        return rest

    def _ends_in_byte_run(self) -> bool:
        """Whether the last decoded token is a ByteFallback byte, so its run may go on."""
        if not self._byte_fallback_ids:
            return False
        for token_id in reversed(self._ids):
            if self.skip_special_tokens and token_id in self._special_ids:
                continue  # skipped tokens do not end a run of bytes
            return token_id in self._byte_fallback_ids
        return False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self) -> tuple[str, str]:
        """Text of the window up to read_offset, and of the whole window."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        return prefix_text, new_text

    def _decode_all(self) -> str | None:
        """Text of every generated id decoded at once, or None if context breaks it."""
        full_text = self._decode(self._ids)
        if not self._num_context_tokens:
            return full_text
        context_text = self._decode(self._ids[: self._num_context_tokens])
        if not full_text.startswith(context_text):
            return None
        return full_text[len(context_text) :]
