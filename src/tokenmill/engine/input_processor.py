"""InputProcessor: the one place a request is checked and turned into engine requests.

Owns validating what a caller submits (prompt text or token ids, SamplingParams against
the loaded model, priority against the scheduling policy), resolving what each request may
generate, and fanning ``n`` samples out into child ``Request``s. Every bound on a request
(context, ``max_tokens``, ``n``/``best_of``/beam width, logprobs, a route's caps) is computed
by ``request_limits``, which only this module calls. The offline ``LLM``,
``LLMEngine.add_request`` and the HTTP server all go through it, once per request: the
server validates on its own side (so a batch of prompts fails before any part starts) and
hands the engine a ``ProcessedRequest``, which the engine thread takes without checking again.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from tokenmill.core.cache_salt import check_cache_salt, compose_salt
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine import request_limits
from tokenmill.engine.request_limits import OFFLINE, InputLimits, RequestCaps
from tokenmill.errors import InvalidRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.pooling_params import PoolingParams
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
    """The request's parameters, ``max_tokens`` resolved (``request_limits``): what it runs with."""
    priority: int
    arrival_time: float
    lora_request: LoRARequest | None = None
    """The adapter it runs with; None: the base model."""
    grammar: CompiledGrammar | None = None
    """The compiled ``params.structured_outputs``, which every child sequence follows."""
    pooling: PoolingParams | None = None
    """Set for a pooling request (embeddings): its hidden states are pooled, nothing sampled."""
    cache_salt: str | None = None
    """The caller's prefix-cache namespace (vLLM's ``cache_salt``; the server adds the API
    key's): only requests with the same one reuse each other's cached blocks."""
    nonce: str = field(default_factory=lambda: secrets.token_hex(16))
    """This request's own prefix-cache namespace where it may share nothing: drawn by the
    server, since a client chooses its request id (``X-Request-Id``) and may send one twice."""


@dataclass(frozen=True)
class CheckedParams:
    """SamplingParams and a priority that passed ``check_params``, shared by a request's prompts."""

    params: SamplingParams
    priority: int
    lora_request: LoRARequest | None = None
    grammar: CompiledGrammar | None = None
    pooling: PoolingParams | None = None
    caps: RequestCaps = OFFLINE
    """The caller's bounds on top of the engine's (a route's, the server's)."""
    cache_salt: str | None = None
    """The prefix-cache namespace every prompt of the request runs in (``ProcessedRequest``)."""


__all__ = [
    "CheckedParams",
    "InputLimits",
    "InputProcessor",
    "ProcessedRequest",
    "RequestCaps",
    "request_cache_salt",
]


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
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> ProcessedRequest:
        """Tokenize a text prompt and check everything; raises InvalidRequestError naming the field."""
        checked = self.check_params(
            params or SamplingParams(), priority, lora_request, cache_salt=cache_salt
        )
        return self.process_prompt(request_id, prompt, checked, arrival_time)

    def check_params(
        self,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        grammar: CompiledGrammar | None = None,
        caps: RequestCaps = OFFLINE,
        cache_salt: str | None = None,
    ) -> CheckedParams:
        """Check what a request's prompts share, once (the server does this before admitting it).

        ``caps`` are the caller's bounds on top of the engine's (``request_limits``). A
        structured-output constraint is compiled here unless the caller already did (the
        server compiles on its own pool with a time budget and passes ``grammar``).
        ``cache_salt`` is None or a non-empty string, as vLLM takes it."""
        cache_salt = check_cache_salt(cache_salt)
        self.validate_params(params, caps)
        self.validate_priority(priority)
        if lora_request is not None and not self.limits.enable_lora:
            raise InvalidRequestError(
                "a LoRA adapter needs the engine to run with --enable-lora", param="lora_request"
            )
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params)
        return CheckedParams(
            params, priority, lora_request, grammar, caps=caps, cache_salt=cache_salt
        )

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
        """Tokenize a text prompt, check it, and pair it with already-checked parameters,
        ``max_tokens`` resolved for this prompt (``request_limits.resolve``)."""
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, list(prompt)
        is_pooling = checked.pooling is not None
        self.validate_prompt(token_ids, is_pooling, checked.caps)
        params = checked.params
        if not is_pooling:
            params = request_limits.resolve(len(token_ids), params, self.limits, checked.caps)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        return ProcessedRequest(
            request_id,
            token_ids,
            prompt_text,
            params,
            checked.priority,
            arrival,
            checked.lora_request,
            checked.grammar,
            checked.pooling,
            checked.cache_salt,
        )

    def validate_prompt(
        self, prompt_token_ids: list[int], is_pooling: bool = False, caps: RequestCaps = OFFLINE
    ) -> None:
        """Reject empty, out-of-vocabulary and over-context prompts with a clear error.

        A pooling prompt (an embedding input) needs no room for output: it may fill the context."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.limits.vocab_size
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"token id {t!r} is outside the vocabulary [0, {vocab})", param="prompt"
                )
        request_limits.check_prompt(len(prompt_token_ids), self.limits, caps, is_pooling)

    def validate_params(self, params: SamplingParams, caps: RequestCaps = OFFLINE) -> None:
        """What SamplingParams cannot check alone: the vocabulary (stop_token_ids, logit_bias),
        and every bound that does not depend on the prompt (``request_limits.check_params``)."""
        vocab = self.limits.vocab_size
        bad = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
        bad_bias = [t for t in params.logit_bias or {} if t >= vocab]
        if bad_bias:
            raise InvalidRequestError(
                f"logit_bias token ids {bad_bias[:5]} are outside the vocabulary [0, {vocab})",
                param="logit_bias",
            )
        request_limits.check_params(params, self.limits, caps)
        if params.use_beam_search:
            self.validate_beam_search(params)

    def validate_beam_search(self, params: SamplingParams) -> None:
        """Beam search ranks by the model's raw log-probabilities (transformers' ``do_sample=False``):
        options that would change the distribution or the text are refused, never ignored."""
        limits = self.limits
        if not limits.supports_beam_search:
            raise InvalidRequestError(
                "use_beam_search needs the paged KV cache (--kv-cache paged): the static "
                "strategy cannot share a beam's KV blocks",
                param="use_beam_search",
            )
        unsupported = {
            "stop": bool(params.stop),
            "logprobs": params.logprobs is not None,
            "prompt_logprobs": params.prompt_logprobs is not None,
            "min_tokens": params.min_tokens > 0,
            "top_p": params.top_p < 1.0,
            "top_k": params.top_k > 0,
            "min_p": params.min_p > 0.0,
            "presence_penalty": params.presence_penalty != 0.0,
            "frequency_penalty": params.frequency_penalty != 0.0,
            "repetition_penalty": params.repetition_penalty != 1.0,
            "structured_outputs": params.structured_outputs is not None,
            "logit_bias": params.logit_bias is not None,
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise InvalidRequestError(
                    f"{name} is not supported with use_beam_search", param=name
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
        salt = request_cache_salt(processed, limits.enable_prefix_caching)
        lora, pooling = processed.lora_request, processed.pooling
        return [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=processed.prompt_token_ids,
                sampling_params=params,
                eos_token_ids=limits.eos_token_ids,
                max_total_tokens=limits.max_total_tokens,
                priority=processed.priority,
                arrival_time=processed.arrival_time,
                cache_salt=salt,
                parent_id=request_id,
                index=i,
                lora_id=lora.lora_int_id if lora is not None else 0,
                grammar=processed.grammar,
                pooling=pooling,
            )
            for i in range(params.n)
        ]


def request_cache_salt(processed: ProcessedRequest, enable_prefix_caching: bool) -> str | None:
    """The ``Request.cache_salt`` of every sequence of ``processed`` (its samples, its beams).

    The caller's namespace (client ``cache_salt``, API key) and the adapter (KV computed with
    one adapter is never reused by another) always count. The request itself counts when
    nothing may be shared beyond it: prefix caching off (its n samples still share the prompt's
    blocks), or a pooling that reads every position (a hit would skip positions it reads).
    """
    lora, pooling = processed.lora_request, processed.pooling
    is_private = not enable_prefix_caching or (pooling is not None and pooling.needs_every_position)
    return compose_salt(
        ("caller", processed.cache_salt),
        ("lora", lora.cache_salt if lora is not None else None),
        ("request", processed.nonce if is_private else None),
    )
