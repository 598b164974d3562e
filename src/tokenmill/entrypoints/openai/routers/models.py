"""``GET /v1/models`` and ``GET /v1/models/{model}``: the served model names and LoRA adapters."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenmill.entrypoints.openai.state import ServerState, get_state

router = APIRouter()

_STARTED = int(time.time())


def _model_card(state: ServerState, name: str) -> dict:
    lora = state.lora_for(name)
    return {
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "tokenmill",
        "root": lora.lora_path if lora is not None else name,  # as vLLM lists adapters
        "parent": (lora.base_model_name or state.default_model) if lora is not None else None,
        "max_model_len": state.engine.max_model_len
        if state.engine.is_ready
        else state.engine_config.max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = get_state(request)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                _model_card(state, n)
                for n in (
                    *state.config.served_model_names,
                    *(lora.lora_name for lora in state.loras.all()),
                )
            ],
        }
    )


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    state = get_state(request)
    return JSONResponse(_model_card(state, state.resolve_model(model)))
