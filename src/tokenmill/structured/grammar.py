"""GrammarCompiler: turns StructuredOutputsParams into a checked llguidance grammar, once.

Why llguidance (docs/structured_outputs.md): its grammars are built lazily with fuel
limits on every step (a hostile schema runs out of fuel instead of stalling a thread),
it rejects unknown JSON-schema keywords and formats with a message, and it reads
``tokenizer.json`` directly. Compiling happens where the caller chooses: the server runs
``compile`` on its own thread pool with a time budget, never on the engine thread.

A compiled grammar is cached by (kind, canonical text); each sequence gets a cheap deep
copy of the cached matcher, which is already past the grammar's construction.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance

from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_SPEC_BYTES = 256 * 2**10
"""Largest schema, regex or grammar text a request may send (400 beyond it)."""
MAX_CACHED_GRAMMARS = 256

_JSON_OPTIONS: Any = {"whitespace_flexible": False, "coerce_one_of": True}
"""Compact JSON: a model cannot spend its whole budget on whitespace between tokens."""

_LIMITS = llguidance.LLParserLimits(
    max_grammar_size=200_000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    verbose_errors=False,
)
"""Per-grammar work bounds: construction and each mask step give up instead of stalling."""


def lark_literal(text: str) -> str:
    """A Lark string literal matching ``text`` exactly (JSON escapes are Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


class CompiledGrammar:
    """A checked grammar; ``new_matcher`` gives each sequence its own matcher state."""

    def __init__(self, key: tuple[str, str], matcher: llguidance.LLMatcher) -> None:
        self.key = key
        self._template = matcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (thread-safe)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        max_spec_bytes: int = MAX_SPEC_BYTES,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_spec_bytes = max_spec_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        """Grammars built (cache misses that succeeded)."""

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use: it walks the whole vocabulary (about 1 s for 150k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json,
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None,
                )
            return self._tokenizer

    def cached(self, params: StructuredOutputsParams) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(params.cache_key)
            if compiled is not None:
                self._cache.move_to_end(params.cache_key)
            return compiled

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The checked grammar for ``params``; InvalidRequestError naming the problem."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        size = params.num_spec_bytes
        if size > self.max_spec_bytes:
            raise InvalidRequestError(
                f"the {params.kind} constraint is {size} bytes; at most {self.max_spec_bytes} are allowed",
                param="structured_outputs",
            )
        grammar = self._grammar_text(params)
        tokenizer = self.tokenizer
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=_LIMITS)
        if error:
            raise _invalid(params, error)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise _invalid(params, matcher.get_error())
        _check_can_start(params, matcher, self.vocab_size)
        compiled = CompiledGrammar(params.cache_key, matcher)
        with self._lock:
            self._cache[params.cache_key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if schema is True:
                    schema = {}
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            if kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=_JSON_OPTIONS
                )
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
            if kind == "choice":
                alternatives = " | ".join(lark_literal(c) for c in params.choice or ())
                return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
            return llguidance.LLMatcher.grammar_from_lark(params.grammar or "")
        except (ValueError, TypeError, RecursionError) as exc:
            raise _invalid(params, str(exc)) from None


_NOISE = re.compile(r"\s+")


def _invalid(params: StructuredOutputsParams, error: str) -> InvalidRequestError:
    """A 400 that names the constraint and says what the grammar engine found wrong."""
    message = _NOISE.sub(" ", error).strip()[:500] or "it cannot be compiled"
    if "NoExtensionBias" in message:  # llguidance's word for an empty language
        message = "no output can satisfy it"
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
    return InvalidRequestError(
        f"invalid {what.get(params.kind, params.kind)}: {message}",
        param="structured_outputs",
    )


def _check_can_start(
    params: StructuredOutputsParams, matcher: llguidance.LLMatcher, vocab_size: int
) -> None:
    """Compute the first masks here, on the compile thread: that warms the lexer (the first
    mask of a huge regex can take seconds, which must never happen on the engine thread), and
    a grammar that runs out of its limits, or allows no token at all, is refused now."""
    mask = matcher.compute_bitmask()
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    for m in (matcher, probe):
        if m.is_error():
            raise _invalid(params, f"it exceeds the grammar engine's limits ({m.get_error()})")
    if not any(mask[: (vocab_size + 7) // 8]):
        raise _invalid(params, "no output can satisfy it")
