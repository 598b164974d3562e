"""SamplingParams: how to turn logits into tokens, with vLLM's field names and defaults.

Validated once at construction so that a bad value fails with a message naming the
field, before the request ever reaches the engine.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.errors import InvalidRequestError

_INT64_MAX = 2**63 - 1
_MAX_N = 128
_MAX_STOP_STRINGS = 64
_MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS_TOKENS = 300
"""Most ``logit_bias`` entries one request may give (each costs the sampler a write)."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RequestOutputKind(enum.Enum):
    """What each of a request's outputs carries (vLLM's names).

    Cumulative outputs copy everything generated so far at every step, which costs
    O(length) per request per step; streaming front ends want DELTA and batch callers
    FINAL_ONLY.
    """

    CUMULATIVE = 0
    """Text, token ids and logprobs so far, at every step."""
    DELTA = 1
    """Only what is new since the previous output; prompt logprobs in the first one."""
    FINAL_ONLY = 2
    """One output, when every completion of the request has finished."""


@dataclass
class SamplingParams:
    """Parameters for one generation request (vLLM-compatible)."""

    n: int = 1
    """Number of completions to return for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted once per previous occurrence of a token in the output."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output."""
    seed: int | None = None
    """Seed of this request's own generator: reproducible whatever else is batched."""
    stop: list[str] | None = None
    """Strings that end generation; excluded from the text unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (kept in token_ids, not rendered as text)."""
    ignore_eos: bool = False
    """Keep generating after the EOS token."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens were generated."""
    logprobs: int | None = None
    """Number of top log-probabilities to return per generated token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    """Number of top log-probabilities to return per prompt token."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    spaces_between_special_tokens: bool = True
    """Kept for vLLM compatibility; the tokenizer's decoder decides spacing."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What each output carries; ``LLM.generate`` uses FINAL_ONLY, the server DELTA."""
    use_beam_search: bool = False
    """Beam search (greedy-equivalent, Transformers' semantics) instead of sampling; paged KV only."""
    best_of: int | None = None
    """With use_beam_search: the beam width (default n); the n best finished beams are returned."""
    length_penalty: float = 1.0
    """Beam search: a finished beam scores sum(logprobs) / (generated tokens ** length_penalty)."""
    early_stopping: bool | str = False
    """Beam search: True stops once beam-width beams finished; False once no running beam can
    beat the worst finished one; "never" also assumes a running beam could reach max_tokens."""
    structured_outputs: StructuredOutputsParams | None = None
    """A JSON schema, regex, choice or grammar the output must match (enforced per token)."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids before any other processing (OpenAI's field:
    each in [-100, 100]; 100 all but forces a token, -100 all but bans it)."""

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:  # an unknown key
                raise InvalidRequestError(
                    f"structured_outputs: {exc}", param="structured_outputs"
                ) from None
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        self._validate_logit_bias(bad)

        if not _is_int(self.n) or not 1 <= self.n <= _MAX_N:
            raise bad("n", f"must be an integer in [1, {_MAX_N}], got {self.n!r}")
        for name, low, high in (
            ("temperature", 0.0, 100.0),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
            ("repetition_penalty", 0.0, 100.0),
        ):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
            if not low <= value <= high:
                raise bad(name, f"must be in [{low}, {high}], got {value!r}")
        if self.top_p <= 0.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.top_k) or self.top_k < 0 or self.top_k > 2**31 - 1:
            raise bad(
                "top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not -_INT64_MAX - 1 <= self.seed <= _INT64_MAX
        ):
            raise bad("seed", f"must be an integer within int64, got {self.seed!r}")
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT64_MAX
        ):
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, f"must be a non-negative integer, got {value!r}")
        stop, stop_token_ids = self.stop or [], self.stop_token_ids or []  # lists by now
        if len(stop) > _MAX_STOP_STRINGS:
            raise bad("stop", f"accepts at most {_MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "strings must be non-empty")
            if len(s) > _MAX_STOP_STRING_CHARS:
                raise bad("stop", f"strings must be at most {_MAX_STOP_STRING_CHARS} characters")
        for t in stop_token_ids:
            if not _is_int(t) or t < 0:
                raise bad("stop_token_ids", f"must be non-negative integers, got {t!r}")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        if not self.spaces_between_special_tokens:
            raise bad(
                "spaces_between_special_tokens",
                "false is not supported (the tokenizer's decoder sets spacing)",
            )
        self._validate_beam_search(bad)

    def _validate_logit_bias(self, bad: Any) -> None:
        """Keys: token ids (ints, or strings of ints as JSON sends them); values: finite
        numbers in [-100, 100]; normalised to ``{int: float}`` (empty: None)."""
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise bad("logit_bias", f"must map token ids to numbers, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise bad(
                "logit_bias", f"accepts at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}"
            )
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = key
            if isinstance(key, str) and key.strip().lstrip("-").isdigit():
                token = int(key)
            if not _is_int(token) or token < 0:
                raise bad(
                    "logit_bias", f"keys must be token ids (non-negative integers), got {key!r}"
                )
            if not _is_real(value) or not math.isfinite(value) or not -100 <= value <= 100:
                raise bad("logit_bias", f"values must be numbers in [-100, 100], got {value!r}")
            out[int(token)] = float(value)
        self.logit_bias = out or None

    def _validate_beam_search(self, bad: Any) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise bad("use_beam_search", "must be a boolean")
        if self.best_of is not None:
            if not _is_int(self.best_of) or not self.n <= self.best_of <= _MAX_N:
                raise bad("best_of", f"must be an integer in [n, {_MAX_N}], got {self.best_of!r}")
            if self.best_of != self.n and not self.use_beam_search:
                raise bad("best_of", "other than n is only supported with use_beam_search")
        if not _is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise bad("length_penalty", f"must be a finite number, got {self.length_penalty!r}")
        if not isinstance(self.early_stopping, bool) and self.early_stopping != "never":
            raise bad(
                "early_stopping", f"must be true, false or 'never', got {self.early_stopping!r}"
            )

    @property
    def beam_width(self) -> int:
        """Beams kept per step under beam search: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        """True when any presence/frequency/repetition penalty applies."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed."""
        return replace(self, **changes)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every public field, for API layers that map request bodies."""
        return [f.name for f in fields(cls)]
