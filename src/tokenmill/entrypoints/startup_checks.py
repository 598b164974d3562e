"""What ``tokenmill serve`` checks before its HTTP server listens.

A server that answers ``/health`` and then dies on its first chat request, or after
"Uvicorn running", hides a broken deployment from whatever started it. So before
listening the server reads, without loading a weight: the model's ``config.json``, its
tokenizer, every chat template (rendered once on a probe conversation), the checkpoint's
headers (names, shapes, offsets: a truncated file is found), and whether the memory the
flags imply (weights, KV budget, LoRA slots) fits. Each failure is one ``TokenmillError``
naming what is wrong; the CLI prints it as one line and exits 1 (2 for a bad flag value). The weights then load
behind ``/health``'s 503 as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import psutil
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import resolve_device, resolve_model_path
from tokenmill.errors import InsufficientMemoryError, InvalidRequestError, ModelLoadError
from tokenmill.model import sizing
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import check_checkpoint, resolve_dtype
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.worker.kv_cache import kv_budget_bytes

logger = logging.getLogger(__name__)

PROBE_CONVERSATION = [{"role": "user", "content": "Hello!"}]
"""What every chat template must render at start-up (a template that cannot has no use)."""
PROBE_RENDER_TIMEOUT_S = 10.0


def check_before_serving(engine_config: EngineConfig) -> ModelConfig:
    """Every start-up check, cheapest first; returns the model's config."""
    path = resolve_model_path(engine_config.model)
    model_config = ModelConfig.from_folder(
        path, engine_config.model_impl, engine_config.hf_config_path
    )
    tokenizer_path = (
        resolve_model_path(engine_config.tokenizer) if engine_config.tokenizer else path
    )
    check_chat_templates(Tokenizer.from_pretrained(tokenizer_path))
    if model_config.model_impl == "transformers":
        return model_config  # no registry layout: the fallback probes its model as it loads
    check_checkpoint(path, model_config)
    check_memory(engine_config, model_config)
    return model_config


def check_chat_templates(tokenizer: Tokenizer) -> None:
    """Render each of the model's chat templates once; ModelLoadError naming the one that fails."""
    for name in sorted(tokenizer.chat_templates):
        try:
            tokenizer.apply_chat_template(
                PROBE_CONVERSATION,
                add_generation_prompt=True,
                chat_template=name,
                time_budget_s=PROBE_RENDER_TIMEOUT_S,
            )
        except InvalidRequestError as exc:
            raise ModelLoadError(
                f"{tokenizer.name_or_path}: chat template {name!r} fails on a one-message "
                f"conversation: {exc.message}"
            ) from None


PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_name",
        "description": "A tool the start-up check offers the template.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}


def template_renders_tools(tokenizer: Tokenizer, chat_template: str | None = None) -> bool:
    """Whether the chat template puts the request's ``tools`` into the prompt.

    Rendered with and without a probe tool: a template that ignores ``tools`` renders the
    same prompt both ways, so a model served with it never learns a tool exists, and
    ``--enable-auto-tool-choice`` can never produce a call. Rendering (rather than reading
    the source for ``tools``) also catches templates that mention tools but never emit them.
    """
    try:
        bare = tokenizer.apply_chat_template(
            PROBE_CONVERSATION, chat_template=chat_template, time_budget_s=PROBE_RENDER_TIMEOUT_S
        )
        offered = tokenizer.apply_chat_template(
            PROBE_CONVERSATION,
            chat_template=chat_template,
            time_budget_s=PROBE_RENDER_TIMEOUT_S,
            tools=[PROBE_TOOL],
        )
    except InvalidRequestError:
        return False
    return offered != bare and "probe_tool_name" in offered


def warn_if_tools_unrendered(
    engine_config: EngineConfig, chat_template: str | None, tool_call_parser: str | None
) -> str | None:
    """For ``--enable-auto-tool-choice``: one warning when the template drops ``tools``."""
    path = resolve_model_path(engine_config.model)
    tokenizer_path = (
        resolve_model_path(engine_config.tokenizer) if engine_config.tokenizer else path
    )
    tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    if template_renders_tools(tokenizer, chat_template):
        return None
    message = (
        f"--enable-auto-tool-choice with --tool-call-parser {tool_call_parser}: the chat "
        "template never renders the request's `tools`, so the model is not told about them "
        "and will not call them; pass a tool-aware template with --chat-template"
    )
    logger.warning(message)
    return message


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Hold back a logger's info lines (the engine logs the same decision when it loads)."""
    quiet = logging.getLogger(logger_name)
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        yield
    finally:
        quiet.setLevel(level)


def check_memory(engine_config: EngineConfig, model_config: ModelConfig) -> None:
    """Weights, the KV budget and the LoRA slots against the memory there is now
    (InsufficientMemoryError naming the flags that size what does not fit)."""
    cfg = engine_config
    device = resolve_device(cfg.device)
    with _quiet("tokenmill.model.loader"):
        dtype = str(resolve_dtype(cfg.dtype, model_config, device)).removeprefix("torch.")
    max_model_len = cfg.max_model_len or model_config.max_position_embeddings
    parts = {
        "weights": sizing.weight_bytes(
            model_config, dtype, max_model_len, cfg.quantization, cfg.quantization_group_size
        )
    }
    if cfg.enable_lora:
        parts["LoRA slots (--max-loras x --max-lora-rank)"] = sizing.lora_slot_bytes(
            model_config, cfg.max_loras, cfg.max_lora_rank, sizing.DTYPE_BYTES[dtype]
        )
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
        if cfg.kv_cache_memory is not None and cfg.kv_cache_memory > 1:
            parts["KV cache (--kv-cache-memory)"] = int(cfg.kv_cache_memory)
    else:
        available = psutil.virtual_memory().available
        parts["KV cache (--kv-cache-memory)"] = kv_budget_bytes(
            cfg.kv_cache_memory, cfg.gpu_memory_utilization, device
        )
    needed = sum(parts.values())
    if needed > available:
        detail = ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in parts.items())
        raise InsufficientMemoryError(
            f"the flags need {needed / 2**30:.2f} GiB of {device.type} memory ({detail}) but "
            f"{available / 2**30:.2f} GiB is available"
        )
