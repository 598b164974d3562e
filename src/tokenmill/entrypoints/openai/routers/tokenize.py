"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), running the model's tokenizer."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.entrypoints.openai.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    decode_json_object,
    validate_model,
)
from tokenmill.entrypoints.openai.routers.chat import chat_prompt_ids
from tokenmill.entrypoints.openai.state import get_state
from tokenmill.errors import InvalidRequestError

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = get_state(request)
    body = validate_model(
        TokenizeRequest,
        decode_json_object(await request.body(), request.headers.get("content-type")),
    )
    body.check()
    state.resolve_model(body.model)
    engine = state.ready_engine()
    tokenizer = engine.tokenizer
    if body.messages is not None:
        ids = await chat_prompt_ids(
            state, body.messages, body, add_special_tokens=bool(body.add_special_tokens)
        )
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        state.tokenization.check_length(body.prompt or "")
        ids = await state.tokenization.run(
            state.tokenization.encode, body.prompt or "", add_special
        )
    result = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(result)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = get_state(request)
    body = validate_model(
        DetokenizeRequest,
        decode_json_object(await request.body(), request.headers.get("content-type")),
    )
    state.resolve_model(body.model)
    engine = state.ready_engine()
    vocab = engine.vocab_size
    for token_id in body.tokens:
        if not 0 <= token_id < vocab:
            raise InvalidRequestError(
                f"token id {token_id} is outside the vocabulary [0, {vocab})", param="tokens"
            )
    # As vLLM answers: special tokens (BOS, EOS, chat markers) are part of the text.
    text = await state.tokenization.run(engine.tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})
