"""Request models of the pooling APIs: ``/v1/embeddings``, ``/pooling``, ``/score`` and ``/rerank``.

Strict like every body (unknown fields are a 400 naming them), with vLLM's names and
defaults: ``input`` is a string, a list of strings, token ids or a list of token-id lists;
``encoding_format`` is ``float`` or ``base64`` (little-endian float32, what the ``openai``
SDK asks for by default); ``dimensions`` cuts a Matryoshka embedding.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import RequestBody
from tokenmill.errors import InvalidRequestError

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


def input_list(value: EmbeddingInput, param: str) -> list[str | list[int]]:
    """The inputs as a list, each a string or token ids; 400 naming ``param`` if one is empty."""
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif value and isinstance(value[0], int):
        items = [list(value)]
    else:
        items = list(value)  # type: ignore[arg-type]
    if not items:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    for i, item in enumerate(items):
        if len(item) == 0:
            raise InvalidRequestError(f"{param}[{i}] must not be empty", param=param)
    return items


class PoolingFields(RequestBody):
    """What every pooling body shares (vLLM's extras)."""

    user: str | None = None
    """Accepted for compatibility; not used."""
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    """Keep only the last N tokens of each input (vLLM's truncation side)."""
    priority: int = 0
    """Lower runs first when the server uses ``--scheduling-policy priority``."""


class EmbeddingRequest(PoolingFields):
    """``POST /v1/embeddings`` (OpenAI's body plus vLLM's extras)."""

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    """vLLM extension: override the checkpoint's normalisation."""

    def inputs(self) -> list[str | list[int]]:
        return input_list(self.input, "input")


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling``: vLLM's raw pooling endpoint (the pooled vector, as ``data``)."""


class ScoreRequest(PoolingFields):
    """``POST /score``: similarity of ``text_1`` to each ``text_2`` (one to many, or pairwise)."""

    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> list[tuple[str, str]]:
        left = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        right = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not left or not right:
            raise InvalidRequestError(
                "text_1 and text_2 must not be empty", param="text_1" if not left else "text_2"
            )
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            raise InvalidRequestError(
                f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1, or as "
                "many as text_2",
                param="text_2",
            )
        return list(zip(left, right, strict=True))


class RerankRequest(PoolingFields):
    """``POST /rerank`` (also ``/v1/rerank``, ``/v2/rerank``): Jina's and Cohere's body."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)
    """How many results to return, best first; 0 or absent: all."""
    return_documents: bool = True
