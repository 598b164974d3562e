"""Tokenizing requests without freezing the server: a cheap length bound, a bounded pool.

Owns turning request text into token ids for every route. A prompt that cannot fit is
refused before it is tokenized: no token stands for more than ``max_chars_per_token``
characters, so a text longer than ``max_model_len`` times that needs more tokens than the
context holds (a 10 MB prompt is refused in microseconds, not after seconds of work).
What could fit is tokenized on a small dedicated pool (``--max-concurrent-tokenizations``
threads), with the tokenizer's GIL-releasing call, so the event loop keeps answering
while a long prompt is encoded and a burst of them queues instead of taking every core.
Chat templates render on the same pool, their output capped at what could fit.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.errors import ContextLengthError

T = TypeVar("T")


class RequestTokenizer:
    """The server's tokenizing pool and the prompt-length bound for the loaded model."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        max_concurrency: int,
        chat_template_timeout_s: float,
        max_request_body_bytes: int,
    ) -> None:
        self.engine = engine
        self.chat_template_timeout_s = chat_template_timeout_s
        """Time budget of a request-supplied chat template's render."""
        self._max_request_body_bytes = max_request_body_bytes
        self._executor = ThreadPoolExecutor(
            max_concurrency, thread_name_prefix="tokenmill-tokenize"
        )

    @functools.cached_property
    def max_prompt_chars(self) -> int | None:
        """Longest text that could fit in the context, or None when the tokenizer cannot say.

        Computed on first use (it decodes the vocabulary once); call ``warm_up`` after loading.
        """
        per_token = self.engine.tokenizer.max_chars_per_token
        return None if per_token is None else self.engine.max_model_len * per_token

    @property
    def max_render_chars(self) -> int:
        """Most characters a chat template may render: what could fit, or twice the body limit."""
        return self.max_prompt_chars or 2 * self._max_request_body_bytes

    def check_length(self, text: str, param: str = "prompt") -> None:
        """Refuse a text that cannot fit in the context, without tokenizing it."""
        bound = self.max_prompt_chars
        if bound is not None and len(text) > bound:
            max_len = self.engine.max_model_len
            raise ContextLengthError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                f"{len(text)} characters, more than any {max_len} tokens of this tokenizer can hold "
                f"({bound} characters).",
                param=param,
            )

    def encode(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Token ids of ``text`` after the length bound (call on the pool, via ``run``)."""
        self.check_length(text, param)
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizing pool; the event loop stays free meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args)
        )

    async def warm_up(self) -> None:
        """Compute the length bound now, so the first request does not pay for it."""
        await self.run(lambda: self.max_prompt_chars)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
