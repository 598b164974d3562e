"""What a benchmark target can tell about itself over HTTP, before any load is sent.

Owns asking a server which model it serves (the first of ``/v1/models``) and borrowing
its tokenizer through ``/tokenize`` and ``/detokenize``, so a random workload can be
built without a local copy of the tokenizer. Two request shapes are understood: vLLM's
(``{"model", "prompt"}`` in, ``{"tokens"}`` out; tokenmill and SGLang use it too) and
llama.cpp's (``{"content"}`` in, ``{"tokens"}`` out). Calls are blocking: they run while
the workload is built, never during a measured run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenmill.bench import MissingExtraError
from tokenmill.bench.client import auth_headers

try:
    import httpx
except ImportError as exc:  # in the bench extra: serving does not need it
    raise MissingExtraError("httpx") from exc

_READY_POLL_INTERVAL_S = 1.0
_SAMPLE_TEXT = (
    "The old harbor town woke slowly: fishermen checked their nets, a baker pulled 24 loaves "
    "from the oven, and children ran along the wet stones toward school. Questions about "
    "weather, prices and politics filled the market; answers were rarely certain. Scientists "
    "measured 3.7 degrees of warming, engineers argued over bridges, and a quiet librarian "
    "catalogued maps, letters, recipes and songs. Why would anyone leave? Perhaps because "
    "distant cities promised music, machines, mathematics and the chance to begin again."
)
"""Varied prose whose tokens random prompts draw from when the vocabulary size is unknown."""


class TargetError(RuntimeError):
    """The target could not answer a question about itself; the message says why."""


def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def first_served_model(
    base_url: str, api_key: str | None = None, ready_timeout_s: float = 0.0
) -> str:
    """The first model ``/v1/models`` lists, retrying for ``ready_timeout_s`` while the
    server refuses connections or answers 503 (still loading)."""
    url = f"{_root(base_url)}/v1/models"
    deadline_s = time.perf_counter() + ready_timeout_s
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        while True:
            try:
                response = client.get(url, headers=auth_headers(api_key))
                if response.status_code == 503 and time.perf_counter() < deadline_s:
                    time.sleep(_READY_POLL_INTERVAL_S)
                    continue
                response.raise_for_status()
                return str(response.json()["data"][0]["id"])
            except httpx.ConnectError as exc:
                if time.perf_counter() >= deadline_s:
                    raise TargetError(f"cannot reach {url}: {exc}") from exc
                time.sleep(_READY_POLL_INTERVAL_S)
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise TargetError(f"{url} did not name a model: {exc}") from exc


class RemoteTokenizer:
    """A server's tokenizer over HTTP, usable wherever the bench tools take a tokenizer.

    The vocabulary size is unknown, so ``sample_token_ids`` offers the ids of a sample
    text for random prompts to draw from; special tokens never appear among them.
    """

    def __init__(
        self, base_url: str, model: str | None, api_key: str | None = None, timeout_s: float = 30.0
    ) -> None:
        self.root_url = _root(base_url)
        self.model = model
        self.style: str | None = None
        """``vllm`` or ``llama.cpp`` once a request succeeded; None until then."""
        self._client = httpx.Client(
            timeout=timeout_s, trust_env=False, headers=auth_headers(api_key)
        )

    @classmethod
    def connect(
        cls,
        base_url: str,
        model: str | None,
        api_key: str | None = None,
        ready_timeout_s: float = 0.0,
    ) -> RemoteTokenizer:
        """A tokenizer that has answered one request, waiting ``ready_timeout_s`` for a
        starting server; raises ``TargetError`` naming what failed."""
        tokenizer = cls(base_url, model, api_key)
        deadline_s = time.perf_counter() + ready_timeout_s
        while True:
            try:
                tokenizer.encode("Hello")
                return tokenizer
            except TargetError as exc:
                is_not_ready = "HTTP 503" in str(exc) or "cannot reach" in str(exc)
                if not is_not_ready or time.perf_counter() >= deadline_s:
                    tokenizer.close()
                    raise
                time.sleep(_READY_POLL_INTERVAL_S)

    def _post(
        self,
        path: str,
        requests: dict[str, tuple[dict[str, Any], str]],
        is_valid: Callable[[Any], bool] | None = None,
    ) -> Any:
        """POST the request of the known style, or each style's until one is answered.

        ``requests`` maps a style to its body and the key of the answer in the response;
        ``is_valid`` may reject an answer (llama.cpp answers a body it cannot read with no
        tokens rather than an error).
        """
        url = f"{self.root_url}{path}"
        errors = []
        for style, (body, answer_key) in requests.items():
            if self.style is not None and style != self.style:
                continue
            try:
                response = self._client.post(url, json=body)
            except httpx.ConnectError as exc:
                raise TargetError(f"cannot reach {url}: {exc}") from exc
            except httpx.HTTPError as exc:
                raise TargetError(f"{url} failed: {type(exc).__name__}: {exc}") from exc
            if response.status_code == 200:
                try:
                    answer = response.json()[answer_key]
                except (ValueError, KeyError, TypeError):
                    answer = None
                if answer is None or (is_valid is not None and not is_valid(answer)):
                    errors.append(
                        f"{style} shape: no usable {answer_key!r} in {' '.join(response.text[:120].split())}"
                    )
                    continue
                self.style = style
                return answer
            errors.append(
                f"{style} shape: HTTP {response.status_code} {' '.join(response.text[:120].split())}"
            )
            if response.status_code == 503:  # loading: the other shape would fail the same way
                break
        raise TargetError(f"{url} did not answer ({'; '.join(errors)})")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``, from ``/tokenize``."""
        model = {"model": self.model} if self.model else {}

        def is_ids(tokens: Any) -> bool:
            return (
                isinstance(tokens, list)
                and all(isinstance(t, int) for t in tokens)
                and bool(tokens or not text)
            )

        return self._post(
            "/tokenize",
            {
                "vllm": (
                    {**model, "prompt": text, "add_special_tokens": add_special_tokens},
                    "tokens",
                ),
                "llama.cpp": ({"content": text, "add_special": add_special_tokens}, "tokens"),
            },
            is_ids,
        )

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, from ``/detokenize`` (the server decides about special tokens)."""
        model = {"model": self.model} if self.model else {}
        return str(
            self._post(
                "/detokenize",
                {
                    "vllm": ({**model, "tokens": list(ids)}, "prompt"),
                    "llama.cpp": ({"tokens": list(ids)}, "content"),
                },
            )
        )

    def sample_token_ids(self) -> list[int]:
        """Distinct ids of a sample text: the pool random prompts draw from."""
        return sorted(set(self.encode(_SAMPLE_TEXT)))

    def close(self) -> None:
        """Release the HTTP connection."""
        self._client.close()
