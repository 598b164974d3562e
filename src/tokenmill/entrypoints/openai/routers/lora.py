"""``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's), behind a flag.

Mounted only with ``--allow-runtime-lora-updating`` (vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``),
and behind the API key like every route. Loading reads and checks the whole adapter off
the event loop before the name exists, so a bad adapter is a 400 naming the problem and
changes nothing. Unloading removes the name at once (new requests naming it get 404),
while requests already admitted on it finish with it; the engine frees the adapter when
the last of them ends. A name loaded again afterwards is a new adapter: new id, no KV or
weights shared with the old one.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.lora import check_lora_name
from tokenmill.entrypoints.openai.protocol import StrictModel, decode_json_object, validate_model
from tokenmill.entrypoints.openai.state import ServerState, get_state
from tokenmill.model.lora import load_lora_adapter

router = APIRouter()


class LoadLoRAAdapterRequest(StrictModel):
    """Body of ``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    """Body of ``POST /v1/unload_lora_adapter``."""

    lora_name: str


def check_adapter(state: ServerState, path: str) -> None:
    """Read the whole adapter and check it against the model (LoRAError if it does not fit)."""
    engine = state.engine.engine
    load_lora_adapter(path, engine.model_config, engine.config.max_lora_rank, torch.float32)


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter_route(request: Request) -> PlainTextResponse:
    state = get_state(request)
    body = validate_model(
        LoadLoRAAdapterRequest,
        decode_json_object(await request.body(), request.headers.get("content-type")),
    )
    state.ready_engine()
    name = body.lora_name

    def check_name() -> None:
        check_lora_name(name, state.base_model_names)
        if name in state.loras:
            raise APIError(
                400, f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )

    check_name()
    await asyncio.to_thread(check_adapter, state, body.lora_path)
    check_name()  # another load of the same name may have finished meanwhile
    state.loras.add(name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter_route(request: Request) -> PlainTextResponse:
    state = get_state(request)
    body = validate_model(
        UnloadLoRAAdapterRequest,
        decode_json_object(await request.body(), request.headers.get("content-type")),
    )
    state.ready_engine()
    lora = state.loras.remove(body.lora_name)
    if lora is None:
        raise APIError(
            404,
            f"The lora adapter '{body.lora_name}' cannot be found.",
            param="lora_name",
            code="model_not_found",
        )
    state.engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
