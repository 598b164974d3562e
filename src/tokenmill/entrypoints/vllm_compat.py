"""Every ``vllm serve`` flag, known to ``tokenmill serve``: implemented, ignored or refused.

``vllm_flags.json`` lists vLLM 0.32's serve flags as its parser defines them (group, kind,
default). Each has one status here:

- ``implemented``: ``tokenmill serve`` has the flag itself, with vLLM's meaning;
- ``ignored``: accepted where it cannot matter on this backend (a CUDA kernel choice, a
  multimodal setting for a text-only engine); giving it logs one warning saying why;
- ``refused``: a feature tokenmill does not have; giving it with any value other than vLLM's
  default (which is what tokenmill does anyway) stops the start-up with one line naming the
  flag and the reason.

So a copied vLLM command line never ends in ``unrecognized arguments`` and nothing is
silently ignored. ``--help`` shows the flags in vLLM's groups; ``docs/vllm_compat.md`` is
generated from this table (``python -m tokenmill.entrypoints.vllm_compat``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from tokenmill.entrypoints.vllm_removed_flags import REMOVED_FLAGS
from tokenmill.errors import ConfigError

logger = logging.getLogger(__name__)

Status = Literal["implemented", "ignored", "refused"]

PENDING_FLAGS: dict[str, str] = {
    "--runner": "pooling models (--runner pooling)",
    "--convert": "pooling models (--convert embed)",
}
"""Implemented by another part of tokenmill (the pooling runner); where this build lacks
them they are refused unless given vLLM's default."""

_ONE_PROCESS = (
    "tokenmill parallelises by tensor parallelism (--tensor-parallel-size) and data-parallel "
    "replicas (--data-parallel-size) only: no pipeline, context or expert parallelism"
)
_TEXT_ONLY = "tokenmill serves text-only models; multimodal settings have nothing to act on"
_CUDA_KERNEL = "selects a CUDA/ROCm kernel; tokenmill has one PyTorch kernel set per device"
_NO_HUB = "tokenmill loads local model folders only (no model hub)"
_NO_PLUGINS = "tokenmill runs no plugin code"

_GROUP_DEFAULTS: dict[str, tuple[Status, str]] = {
    "ParallelConfig": ("refused", _ONE_PROCESS),
    "MultiModalConfig": ("ignored", _TEXT_ONLY),
    "MambaConfig": ("ignored", "no Mamba/SSM model family is supported; nothing to act on"),
    "KernelConfig": ("ignored", _CUDA_KERNEL),
    "AttentionConfig": ("ignored", _CUDA_KERNEL),
    "CompilationConfig": (
        "ignored",
        "CUDA graph capture sizes; tokenmill compiles its static-KV decode step per --compile-batch-sizes",
    ),
    "OffloadConfig": ("refused", "weight offloading is not built"),
}
"""A group's status where no flag of it is listed in ``_FLAGS``."""

_FLAGS: dict[str, tuple[Status, str]] = {
    # ---- options (vLLM's top-level group)
    "--headless": ("refused", _ONE_PROCESS),
    "--api-server-count": ("refused", "one API server process per engine"),
    "--config": ("implemented", "YAML; the command line wins"),
    "--grpc": ("refused", "the gRPC server is not built"),
    "--disable-log-stats": ("implemented", "no periodic throughput/KV log line"),
    "--aggregate-engine-logging": ("ignored", "one engine: its stats are already the aggregate"),
    "--fail-on-environ-validation": ("ignored", "tokenmill reads no VLLM_* environment variables"),
    "--shutdown-timeout": ("implemented", "tokenmill's default drains for 30 s (vLLM: 0)"),
    "--gdn-prefill-backend": ("ignored", "no linear-attention (GDN) model family is supported"),
    "--kda-prefill-backend": ("ignored", "no linear-attention (KDA) model family is supported"),
    "--kda-decode-backend": ("ignored", "no linear-attention (KDA) model family is supported"),
    "--enable-log-requests": ("implemented", "logs each request's prompt and parameters"),
    # ---- Frontend
    "--lora-modules": ("implemented", ""),
    "--chat-template": ("implemented", "a file, or the template itself"),
    "--chat-template-content-format": ("implemented", "auto detects from the template"),
    "--trust-request-chat-template": ("implemented", ""),
    "--trust-request-mm-kwargs": ("ignored", _TEXT_ONLY),
    "--default-chat-template-kwargs": ("implemented", "a request's chat_template_kwargs win"),
    "--response-role": ("implemented", ""),
    "--return-tokens-as-token-ids": ("implemented", "the default of the request field"),
    "--enable-auto-tool-choice": ("implemented", ""),
    "--exclude-tools-when-tool-choice-none": (
        "ignored",
        "tokenmill always leaves tools out of the prompt when tool_choice is none",
    ),
    "--tool-call-parser": ("implemented", "hermes, llama3_json"),
    "--tool-parser-plugin": ("refused", _NO_PLUGINS),
    "--tool-strict-level": (
        "ignored",
        "tool calls under tool_choice required/named are always enforced by the grammar",
    ),
    "--tool-server": ("refused", "built-in tool servers (MCP) are not built"),
    "--max-log-len": ("implemented", ""),
    "--enable-prompt-tokens-details": ("implemented", "usage.prompt_tokens_details.cached_tokens"),
    "--enable-per-request-metrics": ("refused", "per-request timings in responses are not built"),
    "--enable-server-load-tracking": ("implemented", "app.state.server_load_metrics"),
    "--enable-force-include-usage": ("implemented", "usage on every response, streams too"),
    "--sse-keep-alive-interval": ("refused", "SSE keep-alive comments are not built"),
    "--enable-tokenizer-info-endpoint": ("refused", "/tokenizer_info is not built"),
    "--enable-log-outputs": ("implemented", "with --enable-log-requests"),
    "--enable-log-deltas": ("ignored", "outputs are logged once, when the request ends"),
    "--cohere-is-reasoning-model": ("ignored", "the Cohere API is not served"),
    "--cohere-format": ("ignored", "the Cohere API is not served"),
    "--anthropic-disabled-thinking-effort": ("ignored", "Anthropic thinking effort is not mapped"),
    "--log-error-stack": ("ignored", "server errors (5xx) are always logged with their stack"),
    "--tokens-only": ("refused", "the Tokens In<>Out endpoint is not built"),
    "--enable-scale-out": ("refused", _ONE_PROCESS),
    "--fingerprint-mode": ("ignored", "system_fingerprint is always null"),
    "--fingerprint-value": ("ignored", "system_fingerprint is always null"),
    "--host": ("implemented", "tokenmill's default is 127.0.0.1 (vLLM: all interfaces)"),
    "--port": ("implemented", ""),
    "--grpc-port": ("refused", "the gRPC server is not built"),
    "--data-parallel-size": (
        "implemented",
        "replicas behind one prefix-aware front end (docs/scale_out.md)",
    ),
    "--data-parallel-backend": ("implemented", "mp (child processes) or ray (Ray Serve)"),
    "--data-parallel-supervisor-port": ("refused", _ONE_PROCESS),
    "--dp-supervisor-probe-interval-s": ("refused", _ONE_PROCESS),
    "--dp-supervisor-probe-timeout-s": ("refused", _ONE_PROCESS),
    "--dp-supervisor-probe-failure-threshold": ("refused", _ONE_PROCESS),
    "--uds": ("implemented", ""),
    "--uvicorn-log-level": ("implemented", ""),
    "--disable-uvicorn-access-log": ("implemented", "same as --disable-access-log"),
    "--disable-access-log-for-endpoints": ("implemented", ""),
    "--allow-credentials": ("implemented", "CORS"),
    "--allowed-origins": ("implemented", "CORS; a JSON list"),
    "--allowed-methods": ("implemented", "CORS; a JSON list"),
    "--allowed-headers": ("implemented", "CORS; a JSON list"),
    "--api-key": ("implemented", "repeat the flag for several keys"),
    "--ssl-keyfile": ("implemented", ""),
    "--ssl-certfile": ("implemented", ""),
    "--ssl-ca-certs": ("implemented", ""),
    "--enable-ssl-refresh": ("refused", "certificates are read once at start-up"),
    "--ssl-cert-reqs": ("implemented", ""),
    "--ssl-ciphers": ("implemented", ""),
    "--root-path": ("implemented", ""),
    "--middleware": ("refused", _NO_PLUGINS),
    "--enable-request-id-headers": ("ignored", "X-Request-Id is always sent"),
    "--disable-fastapi-docs": ("implemented", "/docs, /redoc and /openapi.json"),
    "--h11-max-incomplete-event-size": ("implemented", "same as --max-header-bytes (16KiB)"),
    "--h11-max-header-count": ("implemented", "same as --max-header-count (100)"),
    "--enable-offline-docs": ("ignored", "the docs pages are FastAPI's"),
    "--enable-flash-late-interaction": ("ignored", _CUDA_KERNEL),
    # ---- ModelConfig
    "--model": ("implemented", "also positional"),
    "--runner": ("implemented", "generate; pooling for embeddings"),
    "--convert": ("implemented", "embed for embeddings"),
    "--tokenizer": ("implemented", "a local folder"),
    "--tokenizer-mode": ("refused", "tokenmill reads tokenizer.json (the hf mode)"),
    "--trust-remote-code": (
        "implemented",
        "accepted; remote code is never run: architectures are tokenmill's own",
    ),
    "--dtype": ("implemented", "half and float as vLLM spells them"),
    "--seed": ("implemented", ""),
    "--hf-config-path": ("implemented", "a local config.json or its folder (no hub)"),
    "--allowed-local-media-path": ("ignored", _TEXT_ONLY),
    "--allowed-media-domains": ("ignored", _TEXT_ONLY),
    "--revision": ("ignored", _NO_HUB),
    "--code-revision": ("ignored", _NO_HUB),
    "--tokenizer-revision": ("ignored", _NO_HUB),
    "--max-model-len": ("implemented", ""),
    "--tensor-parallel-size": (
        "implemented",
        "one worker process per rank (gloo on CPU, NCCL on CUDA)",
    ),
    "--distributed-executor-backend": ("implemented", "uni or mp (ray is not built)"),
    "--quantization": ("implemented", "int8, int4 (weight-only, applied at load)"),
    "--quantization-config": ("refused", "quantization is chosen by --quantization"),
    "--allow-deprecated-quantization": ("ignored", "no deprecated quantization methods"),
    "--enforce-eager": ("implemented", ""),
    "--enable-return-routed-experts": ("refused", "no MoE model family is supported"),
    "--return-sampling-mask": ("refused", "not built"),
    "--max-logprobs": ("implemented", ""),
    "--logprobs-mode": ("refused", "logprobs are always the raw (unprocessed) ones"),
    "--use-fp64-gumbel": ("refused", "not built"),
    "--enable-trace-replay": ("refused", "not built"),
    "--disable-sliding-window": ("refused", "not built"),
    "--disable-cascade-attn": ("ignored", _CUDA_KERNEL),
    "--skip-tokenizer-init": ("refused", "the server always loads the tokenizer"),
    "--enable-prompt-embeds": ("refused", "prompt embeddings as input are not built"),
    "--served-model-name": ("implemented", ""),
    "--config-format": ("refused", "config.json (the hf format) is read"),
    "--hf-token": ("ignored", _NO_HUB),
    "--hf-overrides": ("refused", "config overrides are not built"),
    "--model-class-overrides": ("refused", _NO_PLUGINS),
    "--pooler-config": ("refused", "pooler overrides are not built"),
    "--generation-config": ("implemented", "auto, vllm or a folder"),
    "--override-generation-config": ("implemented", "a JSON object"),
    "--enable-sleep-mode": ("refused", "sleep mode is not built"),
    "--sleep-mode-offload-cudagraph": ("refused", "sleep mode is not built"),
    "--sleep-preserve-parameter-names": ("refused", "sleep mode is not built"),
    "--enable-cumem-allocator": ("ignored", "a CUDA allocator setting"),
    "--enable-nccl-comm-suspend": ("ignored", "an NCCL setting; one device"),
    "--model-impl": ("implemented", "auto, native or transformers (the Transformers fallback)"),
    "--logits-processors": ("refused", _NO_PLUGINS),
    "--io-processor-plugin": ("refused", _NO_PLUGINS),
    "--renderer-num-workers": ("implemented", "same as --max-concurrent-tokenizations (4)"),
    # ---- LoadConfig
    "--load-format": ("implemented", "auto, safetensors; pickle formats refused"),
    "--download-dir": ("ignored", _NO_HUB),
    "--safetensors-load-strategy": ("ignored", "safetensors files are memory-mapped"),
    "--safetensors-prefetch-num-threads": ("ignored", "safetensors files are memory-mapped"),
    "--safetensors-prefetch-block-size": ("ignored", "safetensors files are memory-mapped"),
    "--model-loader-extra-config": ("refused", "not built"),
    "--ignore-patterns": ("ignored", _NO_HUB),
    "--use-tqdm-on-load": ("ignored", "loading is logged, without a progress bar"),
    "--pt-load-map-location": ("ignored", "pickle (.pt) checkpoints are never loaded"),
    # ---- StructuredOutputsConfig
    "--reasoning-parser": ("implemented", "deepseek_r1, qwen3"),
    "--reasoning-parser-plugin": ("refused", _NO_PLUGINS),
    # ---- ParallelConfig (others: refused, one process)
    "--master-addr": ("ignored", _ONE_PROCESS),
    "--master-port": ("ignored", _ONE_PROCESS),
    "--distributed-timeout-seconds": ("ignored", _ONE_PROCESS),
    "--cpu-distributed-timeout-seconds": ("ignored", _ONE_PROCESS),
    "--max-parallel-loading-workers": ("ignored", "weights load in one process"),
    "--ray-workers-use-nsight": ("ignored", "no Ray workers"),
    "--disable-custom-all-reduce": ("ignored", _ONE_PROCESS),
    "--all2all-backend": ("ignored", _ONE_PROCESS),
    # ---- CacheConfig
    "--block-size": ("implemented", "tokenmill's default is 16"),
    "--gpu-memory-utilization": ("implemented", "CUDA only; on CPU see --kv-cache-memory"),
    "--kv-cache-memory-bytes": ("implemented", "same as --kv-cache-memory"),
    "--kv-cache-dtype": ("implemented", ""),
    "--num-gpu-blocks-override": ("refused", "size the KV pool with --kv-cache-memory"),
    "--enable-prefix-caching": ("implemented", ""),
    "--prefix-caching-hash-algo": ("refused", "prefix blocks are hashed with sha256"),
    "--prefix-cache-retention-interval": ("refused", "not built"),
    "--kv-cache-dtype-skip-layers": ("refused", "one KV dtype for every layer"),
    "--kv-sharing-fast-prefill": ("refused", "not built"),
    "--swa-bounded-replay": ("ignored", "no sliding-window KV cache"),
    "--mamba-cache-dtype": ("ignored", "no Mamba/SSM model family is supported"),
    "--mamba-ssm-cache-dtype": ("ignored", "no Mamba/SSM model family is supported"),
    "--mamba-block-size": ("ignored", "no Mamba/SSM model family is supported"),
    "--prefix-match-unit": ("refused", "prefixes match in whole --block-size blocks"),
    "--mamba-cache-mode": ("ignored", "no Mamba/SSM model family is supported"),
    "--enable-mamba-shared-prefix-checkpoint": (
        "ignored",
        "no Mamba/SSM model family is supported",
    ),
    "--replayssm-buffer-len": ("ignored", "no Mamba/SSM model family is supported"),
    "--use-replayssm": ("ignored", "no Mamba/SSM model family is supported"),
    "--kv-offloading-size": ("refused", "KV offloading is not built"),
    "--kv-offloading-backend": ("refused", "KV offloading is not built"),
    # ---- MultiModalConfig (others: ignored)
    "--language-model-only": ("ignored", "tokenmill serves the language model only"),
    # ---- LoRAConfig
    "--enable-lora": ("implemented", ""),
    "--max-loras": ("implemented", ""),
    "--max-lora-rank": ("implemented", ""),
    "--lora-dtype": ("refused", "adapters run in the model dtype"),
    "--enable-tower-connector-lora": ("ignored", _TEXT_ONLY),
    "--max-cpu-loras": ("implemented", ""),
    "--fully-sharded-loras": ("ignored", "one device: nothing to shard"),
    "--lora-target-modules": ("refused", "adapters apply to the modules they name"),
    "--default-mm-loras": ("ignored", _TEXT_ONLY),
    "--specialize-active-lora": ("ignored", "a CUDA kernel specialisation"),
    "--enable-mixed-moe-lora-format": ("ignored", "no MoE model family is supported"),
    "--enable-moe-shared-loras": ("ignored", "no MoE model family is supported"),
    "--max-lora-cls-labels": ("ignored", "no classification models"),
    # ---- LoggingConfig
    "--logging-config": ("refused", "use --log-level; logging config files are not read"),
    "--log-level": ("implemented", ""),
    "--log-config-file": ("refused", "use --log-level; logging config files are not read"),
    # ---- ObservabilityConfig
    "--show-hidden-metrics-for-version": ("ignored", "no vLLM metric is hidden here"),
    "--otlp-traces-endpoint": ("refused", "OpenTelemetry tracing is not built"),
    "--collect-detailed-traces": ("refused", "OpenTelemetry tracing is not built"),
    "--per-request-spec-decode-metrics": (
        "ignored",
        "speculative decoding is counted in /metrics, not per response",
    ),
    "--kv-cache-metrics": ("refused", "KV block residency metrics are not built"),
    "--kv-cache-metrics-sample": ("ignored", "KV block residency metrics are not built"),
    "--custom-histogram-buckets": ("refused", "histograms use vLLM's default buckets"),
    "--cudagraph-metrics": ("ignored", "no CUDA graphs"),
    "--enable-layerwise-nvtx-tracing": ("ignored", "an NVIDIA profiler setting"),
    "--enable-mfu-metrics": ("refused", "MFU metrics are not built"),
    "--enable-logging-iteration-details": ("refused", "not built"),
    "--jit-monitor-mode": ("ignored", "watches CUDA JIT compiles"),
    "--jit-monitor-verbose": ("ignored", "watches CUDA JIT compiles"),
    # ---- SchedulerConfig
    "--max-num-batched-tokens": (
        "implemented",
        "tokenmill's default is 1024 on a CPU, 2048 on a GPU",
    ),
    "--max-num-scheduled-tokens": ("refused", "the step budget is --max-num-batched-tokens"),
    "--max-num-seqs": ("implemented", "tokenmill's default is 256"),
    "--max-num-active-seqs": ("refused", "the running batch is bounded by --max-num-seqs"),
    "--max-num-queued-reqs": ("refused", "use --max-queue-len (sequences beyond --max-num-seqs)"),
    "--max-num-queued-tokens": ("refused", "use --max-queue-len (sequences beyond --max-num-seqs)"),
    "--long-prefill-token-threshold": ("refused", "not built"),
    "--long-prefill-token-threshold-adaptive": ("refused", "not built"),
    "--scheduling-policy": ("implemented", ""),
    "--enable-chunked-prefill": ("implemented", "on by default"),
    "--disable-chunked-mm-input": ("ignored", _TEXT_ONLY),
    "--scheduler-cls": ("refused", _NO_PLUGINS),
    "--scheduler-reserve-full-isl": (
        "ignored",
        "admission already checks the whole prompt fits the KV pool",
    ),
    "--watermark": ("refused", "not built"),
    "--prefill-schedule-interval": ("refused", "waiting requests are admitted every step"),
    "--disable-hybrid-kv-cache-manager": ("ignored", "one KV cache manager per engine"),
    "--async-scheduling": (
        "ignored",
        "steps run one after another; async scheduling overlaps CPU work with a GPU's",
    ),
    "--stream-interval": ("refused", "every step's tokens are streamed at once"),
    # ---- VllmConfig
    "--speculative-config": ("implemented", "methods ngram and draft_model"),
    "--spec-method": ("refused", "use --speculative-config"),
    "--spec-model": ("refused", "use --speculative-config"),
    "--spec-tokens": ("refused", "use --speculative-config"),
    "--watermark-config": ("refused", "output watermarking is not built"),
    "--diffusion-config": ("refused", "diffusion models are not supported"),
    "--kv-transfer-config": ("refused", "disaggregated prefill (KV transfer) is not built"),
    "--kv-events-config": ("refused", "KV cache events are not built"),
    "--ec-transfer-config": ("refused", "encoder cache transfer is not built"),
    "--ec-manager-config": ("ignored", _TEXT_ONLY),
    "--compilation-config": (
        "ignored",
        "CUDA graph and inductor settings; tokenmill has --enforce-eager and --compile-batch-sizes",
    ),
    "--attention-config": ("ignored", _CUDA_KERNEL),
    "--attention-backend": (
        "implemented",
        "tokenmill's backends: torch_sdpa (with its CPU kernels)",
    ),
    "--engram-config": ("refused", "not built"),
    "--reasoning-config": ("refused", "use --reasoning-parser"),
    "--kernel-config": ("ignored", _CUDA_KERNEL),
    "--additional-config": ("refused", "platform plugins are not supported"),
    "--structured-outputs-config": (
        "ignored",
        "structured outputs always use llguidance (--grammar-compile-timeout bounds it)",
    ),
    "--aux-output-config": ("refused", "not built"),
    "--profiler-config": ("refused", "the torch profiler endpoints are not built"),
    "--optimization-level": ("ignored", "a CUDA compilation level; see --enforce-eager"),
    "--performance-mode": ("ignored", "a CUDA graph tuning preset"),
    "--weight-transfer-config": ("refused", "weight transfer (RL) is not built"),
}


@dataclass(frozen=True)
class VLLMFlag:
    """One ``vllm serve`` flag and what tokenmill does with it."""

    flag: str
    group: str
    kind: str
    """flag (store_true), bool (--x/--no-x), value, values (one or more), optional, append."""
    default: Any
    aliases: tuple[str, ...]
    choices: tuple[str, ...] | None
    vllm_help: str
    status: Status
    note: str

    @property
    def dest(self) -> str:
        return "vllm_compat_" + self.flag.removeprefix("--").replace("-", "_")


@functools.cache
def vllm_flags() -> tuple[VLLMFlag, ...]:
    """vLLM's serve flags in vLLM's order, each with tokenmill's status."""
    data = json.loads(
        resources.files("tokenmill.entrypoints").joinpath("vllm_flags.json").read_text()
    )
    flags = []
    for entry in data["flags"]:
        name = entry["flag"]
        status, note = _FLAGS.get(name) or _GROUP_DEFAULTS.get(entry["group"]) or ("refused", "")
        flags.append(
            VLLMFlag(
                flag=name,
                group=entry["group"],
                kind=entry["kind"],
                default=entry["default"],
                aliases=tuple(entry.get("aliases", ())),
                choices=tuple(entry["choices"]) if entry.get("choices") else None,
                vllm_help=entry["help"],
                status=status,
                note=note or ("" if status == "implemented" else "not built"),
            )
        )
    return tuple(flags)


def vllm_version() -> str:
    data = json.loads(
        resources.files("tokenmill.entrypoints").joinpath("vllm_flags.json").read_text()
    )
    return str(data["vllm_version"])


class VLLMGroups:
    """The serve parser's help groups in vLLM's order; flags vLLM lacks go to tokenmill's own."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self._parser = parser
        self._group_of = {f.flag: f.group for f in vllm_flags()}
        self._groups: dict[str, Any] = {}
        for flag in vllm_flags():
            if flag.group == "options":  # vLLM's top-level flags share argparse's own group
                self._groups[flag.group] = parser._optionals
            elif flag.group not in self._groups:
                self._groups[flag.group] = parser.add_argument_group(flag.group)

    def __call__(self, flag: str) -> Any:
        """The group of a vLLM flag, or None for a tokenmill-only one."""
        group = self._group_of.get(flag)
        return self._groups[group] if group is not None else None


def add_vllm_compat_args(parser: argparse.ArgumentParser, groups: VLLMGroups) -> None:
    """Add every vLLM flag ``parser`` does not define itself, in its vLLM group.

    They parse as vLLM's do and default to nothing (``SUPPRESS``), so after parsing a
    namespace holds exactly the ones given; ``check_vllm_compat_args`` judges them.
    """
    known = set(parser._option_string_actions)
    for flag in vllm_flags():
        if flag.flag in known:
            continue
        status, note = flag.status, flag.note
        if status == "implemented":  # another part of tokenmill owns it, absent in this build
            status, note = (
                "refused",
                f"{PENDING_FLAGS.get(flag.flag, 'this feature')} is not in this build",
            )
        names = [flag.flag, *(a for a in flag.aliases if a not in known)]
        kwargs: dict[str, Any] = {
            "dest": flag.dest,
            "default": argparse.SUPPRESS,
            "help": f"vLLM's flag, {status} here"
            + (f" (unless {_shown(flag.default)}, vLLM's default)" if status == "refused" else "")
            + f": {note}",
        }
        if flag.kind == "flag":
            kwargs["action"] = "store_true"
        elif flag.kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.kind == "append":
            kwargs["action"] = "append"
        elif flag.kind == "values":
            kwargs["nargs"] = "+"
        elif flag.kind == "optional":
            kwargs["nargs"] = "?"
            kwargs["const"] = True
        if flag.kind not in ("flag", "bool"):
            kwargs["metavar"] = flag.flag.removeprefix("--").replace("-", "_").upper()
        (groups(flag.flag) or parser).add_argument(*names, **kwargs)
    removed = parser.add_argument_group("flags of earlier vLLM releases")
    for gone in REMOVED_FLAGS:
        if gone.flag in parser._option_string_actions:
            continue
        what = "ignored with a warning" if gone.fate == "harmless" else "refused"
        extra: dict[str, Any] = {"action": "store_true"}
        if gone.kind == "value":
            extra = {"action": "store", "metavar": "VALUE"}
        removed.add_argument(
            gone.flag,
            dest=gone.dest,
            default=argparse.SUPPRESS,
            help=f"removed from vLLM, {what} here: {gone.note}",
            **extra,
        )


def _shown(default: Any) -> str:
    return "not given" if default is None else json.dumps(default)


def _is_vllm_default(given: Any, default: Any) -> bool:
    """Whether a value given on the command line is vLLM's default for the flag."""

    def norm(value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    given, default = norm(given), norm(default)
    if isinstance(given, list) and len(given) == 1 and not isinstance(default, list):
        given = given[0]
    if given == default:
        return True
    return default is None and given in ("", [], {}, "None", "none")


def check_vllm_compat_args(
    args: argparse.Namespace, warn: Callable[[str], None] | None = None
) -> list[str]:
    """Judge the vLLM flags given that tokenmill does not implement.

    Returns (and logs) one warning per ignored flag; raises ConfigError naming the first
    refused one given with a value other than vLLM's default.
    """
    warn = warn or logger.warning
    warnings = []
    for flag in vllm_flags():
        if not hasattr(args, flag.dest):
            continue
        given = getattr(args, flag.dest)
        status, note = flag.status, flag.note
        if status == "implemented":
            status, note = (
                "refused",
                f"{PENDING_FLAGS.get(flag.flag, 'this feature')} is not in this build",
            )
        if status == "ignored":
            message = f"{flag.flag} is ignored: {note}"
            warn(message)
            warnings.append(message)
        elif not _is_vllm_default(given, flag.default):
            raise ConfigError(f"{flag.flag} is not supported: {note}")
    for gone in REMOVED_FLAGS:
        if not hasattr(args, gone.dest):
            continue
        if gone.fate == "replaced":
            raise ConfigError(gone.message())
        warn(gone.message())
        warnings.append(gone.message())
    return warnings


def compat_table_markdown() -> str:
    """``docs/vllm_compat.md``: every vLLM serve flag with tokenmill's status."""
    flags = vllm_flags()
    counts = {s: sum(f.status == s for f in flags) for s in ("implemented", "ignored", "refused")}
    lines = [
        "# vLLM `serve` flags in `tokenmill serve`",
        "",
        "<!-- Generated by `python -m tokenmill.entrypoints.vllm_compat > docs/vllm_compat.md`;"
        " tests/entrypoints/test_vllm_compat.py checks it is up to date. -->",
        "",
        f"Every flag of `vllm serve` {vllm_version()} ({len(flags)} flags; "
        "`vllm serve --help=all`) is known to `tokenmill serve`: none ends in "
        "`unrecognized arguments`, and `tokenmill serve --help` lists them in vLLM's groups.",
        "",
        f"- **implemented** ({counts['implemented']}): tokenmill has the flag, with vLLM's meaning.",
        f"- **ignored** ({counts['ignored']}): accepted, where it cannot matter on this backend; "
        "giving it logs one warning at start-up saying why.",
        f"- **refused** ({counts['refused']}): a feature tokenmill does not have. Given with vLLM's "
        "default value it is accepted (that is what tokenmill does); any other value stops the "
        "start-up with one line naming the flag and the reason.",
        "",
    ]
    group = None
    for flag in flags:
        if flag.group != group:
            group = flag.group
            lines += ["", f"## {group}", "", "| flag | status | note |", "|---|---|---|"]
        names = ", ".join(f"`{n}`" for n in (flag.flag, *flag.aliases))
        lines.append(f"| {names} | {flag.status} | {flag.note.replace('|', '/')} |")
    lines += [
        "",
        "## Flags of earlier vLLM releases",
        "",
        f"Dropped by vLLM before {vllm_version()}, still found in deployment scripts: a "
        "harmless one is accepted with a deprecation warning, a replaced one stops the "
        "start-up naming its replacement.",
        "",
        "| flag | here | why, or the replacement |",
        "|---|---|---|",
    ]
    for gone in REMOVED_FLAGS:
        fate = "ignored, warns" if gone.fate == "harmless" else "refused"
        lines.append(f"| `{gone.flag}` | {fate} | {gone.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(compat_table_markdown(), end="")
