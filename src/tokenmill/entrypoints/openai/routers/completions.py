"""``POST /v1/completions``: text completion of one or many prompts, streamed or not.

Owns the completions wire format: choices indexed ``prompt_index * n + i`` (as vLLM and
OpenAI do for batched prompts), ``echo`` (the prompt's text, and its logprobs when
``logprobs`` is set), the legacy logprobs object, and the usage chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tokenmill.entrypoints.openai.generation import ChoiceDelta, GenerationRun
from tokenmill.entrypoints.openai.generation_request import (
    ParsedRequest,
    check_params,
    compile_grammar,
    parse_request,
    process_prompts,
)
from tokenmill.entrypoints.openai.generation_response import (
    ChunkWriter,
    choice_logprob_entries,
    finite_logprob,
    respond,
    token_label,
)
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.outputs import PositionLogprobs, RequestOutput

router = APIRouter()


def completion_logprobs(
    token_ids: list[int],
    entries: Sequence[PositionLogprobs | None] | None,
    tokenizer: Any,
    text_offset: int,
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset.

    Offsets index the choice's text even when tokens are labelled ``token_id:N``."""
    result: dict[str, Any] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, text, logprob, top in choice_logprob_entries(token_ids, entries, tokenizer):
        result["tokens"].append(token_label(token_id, text, as_token_ids))
        result["token_logprobs"].append(logprob)
        result["top_logprobs"].append(
            {token_label(t, t_text, as_token_ids): lp for t, t_text, lp in top}
            if logprob is not None
            else None
        )
        result["text_offset"].append(text_offset)
        text_offset += len(text)
    return result


def vllm_prompt_logprobs(
    output: RequestOutput | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, text."""
    if output is None or output.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": finite_logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entry.items()
        }
        for entry in output.prompt_logprobs
    ]


def _merge_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {k: first[k] + second[k] for k in first}


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    req = await parse_request(request, CompletionRequest, "cmpl")
    body = req.body
    engine = req.state.engine
    want_prompt_logprobs = body.echo and body.logprobs is not None
    params = body.sampling_params(
        body.max_tokens,
        body.logprobs,
        prompt_logprobs=body.logprobs if want_prompt_logprobs else body.prompt_logprobs,
    )
    grammar = await compile_grammar(req.state, params, body.structured_outputs_params()[1])
    checked = check_params(req, params, body.priority, grammar)
    prompt_list = body.prompt_list()
    req.admit(len(prompt_list), params.n, params.use_beam_search)
    prompts = await process_prompts(req, prompt_list, checked, body.add_special_tokens)
    if body.echo:  # token-id prompts are echoed as their text
        prompts = [
            p
            if p.prompt_text is not None
            else replace(
                p,
                prompt_text=engine.tokenizer.decode(p.prompt_token_ids, skip_special_tokens=False),
            )
            for p in prompts
        ]
    run = GenerationRun(req.state, req.request_id, prompts)
    return await respond(
        req,
        run,
        "text_completion",
        stream=lambda: _stream(req, run),
        build_choices=lambda outputs: _choices(run, body, outputs),
    )


def _echo_prefix(
    run: GenerationRun, body: CompletionRequest, prompt_index: int, output: RequestOutput | None
) -> tuple[str, dict[str, Any] | None]:
    """(text, logprobs) that echo puts before a choice of this prompt."""
    prompt = run.prompts[prompt_index]
    if not body.echo:
        return "", None
    text = prompt.prompt_text or ""
    if body.logprobs is None:
        return text, None
    tokenizer = run.state.engine.tokenizer
    entries = output.prompt_logprobs if output is not None else None
    return text, completion_logprobs(
        prompt.prompt_token_ids, entries, tokenizer, 0, body.return_tokens_as_token_ids
    )


def _choices(
    run: GenerationRun, body: CompletionRequest, outputs: list[RequestOutput | None]
) -> list[dict[str, Any]]:
    tokenizer = run.state.engine.tokenizer
    n = run.params.n
    choices = []
    for prompt_index, output in enumerate(outputs):
        echo_text, echo_logprobs = _echo_prefix(run, body, prompt_index, output)
        completions = output.outputs if output is not None else []
        by_index = {c.index: c for c in completions}
        for i in range(n):
            c = by_index.get(i)
            text = c.text if c is not None else ""
            logprobs = None
            if body.logprobs is not None:
                ids = c.token_ids if c is not None else []
                logprobs = completion_logprobs(
                    ids,
                    c.logprobs if c else None,
                    tokenizer,
                    len(echo_text),
                    body.return_tokens_as_token_ids,
                )
                if echo_logprobs is not None:
                    logprobs = _merge_logprobs(echo_logprobs, logprobs)
            choice = {
                "index": prompt_index * n + i,
                "text": echo_text + text,
                "logprobs": logprobs,
                "finish_reason": (c.finish_reason if c is not None else None) or "length",
                "stop_reason": c.stop_reason if c is not None else None,
            }
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(output)
            if body.return_token_ids:
                choice["prompt_token_ids"] = run.prompts[prompt_index].prompt_token_ids
                choice["token_ids"] = list(c.token_ids) if c is not None else []
            choices.append(choice)
    return choices


async def _stream(
    req: ParsedRequest[CompletionRequest], run: GenerationRun
) -> AsyncIterator[bytes]:
    body = req.body
    tokenizer = run.state.engine.tokenizer
    n = run.params.n
    offsets = [0] * run.num_choices
    echoed: set[int] = set()
    first_extra: dict[int, Any] = {}
    first_ids: dict[int, list[int]] = {}
    chunk = ChunkWriter(req, run, "text_completion")
    async for batch in run.deltas():
        choices = []
        for d in batch:
            text, logprobs = d.text, None
            if body.logprobs is not None:
                logprobs = completion_logprobs(
                    d.token_ids,
                    d.logprobs,
                    tokenizer,
                    offsets[d.index],
                    body.return_tokens_as_token_ids,
                )
            if d.index not in echoed:
                echoed.add(d.index)
                prompt_index = d.index // n
                echo_text, echo_logprobs = _echo_prefix(
                    run, body, prompt_index, run.latest[prompt_index]
                )
                text = echo_text + text
                if echo_logprobs is not None and logprobs is not None:
                    logprobs = _merge_logprobs(
                        echo_logprobs,
                        completion_logprobs(
                            d.token_ids,
                            d.logprobs,
                            tokenizer,
                            len(echo_text),
                            body.return_tokens_as_token_ids,
                        ),
                    )
                if body.prompt_logprobs is not None:
                    first_extra[d.index] = vllm_prompt_logprobs(run.latest[prompt_index])
                if body.return_token_ids:
                    first_ids[d.index] = run.prompts[prompt_index].prompt_token_ids
            offsets[d.index] += len(text)
            choice = _stream_choice(d, text, logprobs)
            if d.index in first_extra:
                choice["prompt_logprobs"] = first_extra.pop(d.index)
            if body.return_token_ids:
                if d.index in first_ids:
                    choice["prompt_token_ids"] = first_ids.pop(d.index)
                choice["token_ids"] = d.token_ids
            choices.append(choice)
        yield chunk(choices)
    if body.include_usage:
        yield chunk.usage()


def _stream_choice(d: ChoiceDelta, text: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "index": d.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": d.finish_reason,
        "stop_reason": d.stop_reason,
    }
