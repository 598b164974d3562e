"""How many tokens a request may generate: the one rule wherever ``max_tokens`` meets a limit.

A request generates at most its ``max_tokens`` (None: no bound of its own), never past the
context left after its prompt, and a prompt that leaves no room is refused with a
``ContextLengthError`` (400 ``context_length_exceeded`` over HTTP). The engine's context
(``--max-model-len``, the KV cache's per-request bound), a route's smaller context and beam
search all bound it here; an operator's cap (the generation config's ``max_new_tokens``) goes
through ``capped``. No torch.
"""

from __future__ import annotations

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.errors import ContextLengthError


def output_room(num_prompt_tokens: int, max_len: int, context: str) -> int:
    """Tokens left for output after the prompt in a context of ``max_len``.

    ``context`` opens the error (e.g. "This model's maximum context length is 64 tokens")."""
    if num_prompt_tokens >= max_len:
        raise ContextLengthError(
            f"{context}. However, your prompt has {num_prompt_tokens} tokens, "
            "leaving no room for output.",
            param="prompt",
        )
    return max_len - num_prompt_tokens


def bounded(max_tokens: int | None, room: int) -> int:
    """The request's ``max_tokens``, no more than ``room`` (all of it when None)."""
    return room if max_tokens is None else min(max_tokens, room)


def capped(max_tokens: int | None, cap: int | None) -> int | None:
    """``max_tokens`` under an operator's cap, which is also the default when none is asked."""
    if cap is None:
        return max_tokens
    return cap if max_tokens is None else min(max_tokens, cap)


def clamp(params: SamplingParams, room: int) -> SamplingParams:
    """``params`` with ``max_tokens`` (and ``min_tokens``) within ``room``; the same object when
    they already are."""
    if params.max_tokens is not None and params.max_tokens <= room:
        return params
    return params.clone(max_tokens=room, min_tokens=min(params.min_tokens, room))
