"""Pooling runs: the inputs of one pooling request (embeddings, scores), through the engine.

Owns what ``/v1/embeddings``, ``/pooling``, ``/score`` and ``/rerank`` share: the pooling
the request asks for checked against the checkpoint's (``dimensions`` only on a Matryoshka
model), every input tokenized off the event loop and submitted as a prompt-only engine
request, batched with everything else by the scheduler, under the same admission,
``--request-timeout``, drain and metrics as generation (``GenerationRun``).
"""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import replace
from typing import Any, TypeVar

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.generation import GenerationRun
from tokenmill.entrypoints.openai.generation_request import ParsedRequest, process_prompts
from tokenmill.entrypoints.openai.pooling_protocol import PoolingFields
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling_params import PoolingParams


def pooling_params(
    req: ParsedRequest[Any], dimensions: int | None = None, normalize: bool | None = None
) -> PoolingParams:
    """The checkpoint's pooling with the request's ``dimensions`` and ``normalize``; 400 if impossible."""
    engine = req.state.engine.engine
    config = engine.pooler_config
    assert config is not None  # the route checked --runner pooling
    if dimensions is not None:
        problem = config.dimensions_error(dimensions, engine.model_config.hidden_size)
        if problem is not None:
            raise InvalidRequestError(problem, param="dimensions")
    params = config.params(dimensions)
    return params if normalize is None else replace(params, normalize=normalize)


PoolT = TypeVar("PoolT", bound=PoolingFields)


async def pool_inputs(
    req: ParsedRequest[PoolT],
    inputs: list[str | list[int]],
    pooling: PoolingParams,
    input_param: str = "input",
) -> tuple[list[list[float]], int]:
    """Each input's pooled vector, in order, and the prompt tokens they took."""
    body, state = req.body, req.state
    checked = state.engine.check_params(
        SamplingParams(max_tokens=1),
        body.priority,
        req.lora_request,
        caps=req.caps,
        pooling=pooling,
        cache_salt=req.cache_salt,
    )
    req.admit(len(inputs), 1)
    if body.truncate_prompt_tokens is not None:
        inputs = [await _truncated(req, item, body.truncate_prompt_tokens) for item in inputs]
    try:
        prompts = await process_prompts(req, inputs, checked, body.add_special_tokens)
    except InvalidRequestError as exc:  # ContextLengthError too
        if exc.param == "prompt":
            exc.param = input_param  # the field this API calls its inputs
        raise
    run = GenerationRun(state, req.request_id, prompts)
    outputs = await run.collect_for(req.http)
    vectors = [out.pooled if out is not None and out.pooled is not None else [] for out in outputs]
    if any(not v for v in vectors):  # a timeout: pooling has no partial result
        raise APIError(
            503, "the request timed out before every input was pooled", code="request_timeout"
        )
    return vectors, run.num_prompt_tokens


async def _truncated(req: ParsedRequest[Any], item: str | list[int], keep: int) -> list[int]:
    """The last ``keep`` tokens of an input, as vLLM truncates."""
    if isinstance(item, list):
        return item[-keep:]
    ids = await req.state.tokenization.run(
        req.state.tokenization.encode, item, req.body.add_special_tokens
    )
    return ids[-keep:]


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list; ``base64``: little-endian float32 bytes, as vLLM and OpenAI send."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
