"""InputProcessor: the one place a request is checked and turned into engine requests.

Owns validating what a caller submits (prompt text or token ids, SamplingParams against
the loaded model, priority against the scheduling policy) and fanning ``n`` samples out
into child ``Request``s. The offline ``LLM``, ``LLMEngine.add_request`` and the HTTP server
all go through it, once per request: the server validates on its own side (so a batch of
prompts fails before any part starts) and hands the engine a ``ProcessedRequest``, which the
engine thread takes without checking again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.core.request import Request
from tokenmill.errors import ContextLengthError, InvalidRequestError
from tokenmill.sampling.params import SamplingParams
from tokenmill.structured.grammar import CompiledGrammar, GrammarCompiler
from tokenmill.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ProcessedRequest:
    """A request that passed every check: what the engine queues as it is."""

    request_id: str
    prompt_token_ids: list[int]
    prompt_text: str | None
    """Kept for outputs that echo the prompt; None when the caller sent token ids."""
    params: SamplingParams
    priority: int
    arrival_time: float
    grammar: CompiledGrammar | None = None
    """The compiled ``params.structured_outputs``, which every child sequence follows."""


@dataclass(frozen=True)
class CheckedParams:
    """SamplingParams and a priority that passed ``check_params``, shared by a request's prompts."""

    params: SamplingParams
    priority: int
    grammar: CompiledGrammar | None = None


@dataclass(frozen=True)
class InputLimits:
    """What a request is checked against: fixed once the model and KV cache are loaded."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    """The most tokens one request can hold in the KV cache."""
    max_logprobs: int
    scheduling_policy: str
    eos_token_ids: frozenset[int]
    enable_prefix_caching: bool


class InputProcessor:
    """Tokenizes and validates requests, and fans ``n`` out into child requests."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: InputLimits,
        grammar_compiler: GrammarCompiler | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.grammar_compiler = grammar_compiler

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Tokenize a text prompt and check everything; raises InvalidRequestError naming the field."""
        return self.process_prompt(
            request_id,
            prompt,
            self.check_params(params or SamplingParams(), priority),
            arrival_time,
        )

    def check_params(
        self, params: SamplingParams, priority: int = 0, grammar: CompiledGrammar | None = None
    ) -> CheckedParams:
        """Check what a request's prompts share, once (the server does this before admitting it).

        A structured-output constraint is compiled here unless the caller already did (the
        server compiles on its own pool with a time budget and passes ``grammar``)."""
        self.validate_params(params)
        self.validate_priority(priority)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params)
        return CheckedParams(params, priority, grammar)

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The checked grammar of ``params.structured_outputs`` (cached); 400 naming the problem."""
        if params.structured_outputs is None:
            return None
        if self.grammar_compiler is None:
            raise InvalidRequestError(
                "structured outputs are not available for this model", param="structured_outputs"
            )
        return self.grammar_compiler.compile(params.structured_outputs)

    def process_prompt(
        self,
        request_id: str,
        prompt: str | list[int],
        checked: CheckedParams,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Tokenize a text prompt, check it, and pair it with already-checked parameters."""
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, list(prompt)
        self.validate_prompt(token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        return ProcessedRequest(
            request_id,
            token_ids,
            prompt_text,
            checked.params,
            checked.priority,
            arrival,
            checked.grammar,
        )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Reject empty, out-of-vocabulary and over-context prompts with a clear error."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.limits.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"token id {t!r} is outside the vocabulary [0, {vocab})", param="prompt"
                )
        max_len = self.limits.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise ContextLengthError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt has {len(prompt_token_ids)} tokens, leaving no room for output.",
                param="prompt",
            )
        kv_capacity = self.limits.kv_capacity_tokens
        if len(prompt_token_ids) >= kv_capacity:
            raise ContextLengthError(
                f"the prompt ({len(prompt_token_ids)} tokens) does not fit the KV cache ({kv_capacity} tokens)",
                param="prompt",
            )

    def validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the vocabulary and the logprobs limit."""
        vocab = self.limits.vocab_size
        bad = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
        max_logprobs = self.limits.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise InvalidRequestError(
                    f"{name} must be at most {max_logprobs}, got {value}", param=name
                )

    def validate_priority(self, priority: int) -> None:
        """A priority other than 0 only means something under the priority policy: never ignore it."""
        if priority != 0 and self.limits.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority requires the engine to run with --scheduling-policy priority",
                param="priority",
            )

    def fan_out(self, processed: ProcessedRequest) -> list[Request]:
        """The child requests of one processed request: one per sample of ``n``."""
        limits, params, request_id = self.limits, processed.params, processed.request_id
        # Without prefix caching, the n samples of one request still share its prompt blocks.
        salt = None if limits.enable_prefix_caching else request_id
        return [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=processed.prompt_token_ids,
                sampling_params=params,
                eos_token_ids=limits.eos_token_ids,
                max_total_tokens=min(limits.max_model_len, limits.kv_capacity_tokens),
                priority=processed.priority,
                arrival_time=processed.arrival_time,
                cache_salt=salt,
                parent_id=request_id,
                index=i,
                grammar=processed.grammar,
            )
            for i in range(params.n)
        ]
