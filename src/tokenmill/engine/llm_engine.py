"""LLMEngine: the synchronous core loop tying scheduler, runner and output processor.

Data flows one way each ``step()``: scheduler -> model runner (forward + sampler) ->
request state update -> output processor -> RequestOutputs. Everything a caller does
(add, abort, step) happens on one thread; the async server wraps this object.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv import KVCacheManager, KVSizing, build_kv_manager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.speculative import (
    SpeculativeConfig,
    max_draft_tokens,
    max_verify_rows,
    num_tokens_to_propose,
    propose_ngram,
)
from tokenmill.core.stats import EngineStats, StartupCosts
from tokenmill.engine.beam_search import BeamLimits, BeamSearchCoordinator
from tokenmill.engine.input_processor import InputLimits, InputProcessor, ProcessedRequest
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import ConfigError, InvalidRequestError, RequestFailedError
from tokenmill.lora_request import LoRARequest
from tokenmill.model.attention import FP8_DTYPES
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.cpu import cpu_info, default_num_threads
from tokenmill.model.loader import load_model, resolve_dtype
from tokenmill.model.registry import resolve_model_impl
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolerConfig
from tokenmill.sampling.sampler import Sampler
from tokenmill.sampling.speculative import VerifiedTokens
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.worker.compiled_step import CompiledDecodeStep, default_buckets
from tokenmill.worker.draft_proposer import DraftProposer
from tokenmill.worker.kv_cache import allocate_kv_cache, kv_budget_bytes, kv_bytes_per_token
from tokenmill.worker.lora_manager import LoRAManager
from tokenmill.worker.model_runner import ModelRunner, StepOutput

logger = logging.getLogger(__name__)


def resolve_model_path(model: str) -> Path:
    """``demo`` means the built-in demo model; ``demo-draft`` its draft for speculative
    decoding (built from it on first use)."""
    if model == "demo":
        from tokenmill.model.demo import demo_model_path

        return demo_model_path()
    if model == "demo-draft":
        from tokenmill.model.demo import demo_draft_path

        return demo_draft_path()
    return Path(model)


KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = {dtype: name for name, dtype in KV_CACHE_DTYPES.items()}
KV_CACHE_DTYPES["fp8"] = torch.float8_e4m3fn  # vLLM's alias


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """``auto`` stores K/V in the model dtype; anything else as named (vLLM's names)."""
    return model_dtype if requested == "auto" else KV_CACHE_DTYPES[requested]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _generation_eos_ids(folder: Path) -> set[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        logger.warning("ignoring unreadable %s", path)
        return set()
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _with_verify_bucket(config: EngineConfig, buckets: list[int]) -> list[int]:
    """static + speculation: one more compiled batch size when a step verifying drafts can
    have more rows (k + 1 per request) than the largest decode bucket (not with
    ``--compile-batch-sizes``: those are taken as given)."""
    spec = config.speculative
    if spec is None or config.compile_batch_sizes:
        return buckets
    rows = max_verify_rows(spec, config.max_num_seqs)
    return buckets + [rows] if rows > max(buckets, default=0) else buckets


class LLMEngine:
    """Loads a model and serves many requests at once with continuous batching."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_folder(self.model_path, config.model_impl)
        _, impl_reason = resolve_model_impl(self.model_config.architecture, config.model_impl)
        logger.info("model implementation: %s (%s)", self.model_config.model_impl, impl_reason)
        if self.model_config.model_impl == "transformers":
            from tokenmill.model.transformers_fallback import check_features

            check_features(config.quantization, config.enable_lora)
        if config.rope_theta_override is not None:
            self.model_config = replace(self.model_config, rope_theta=config.rope_theta_override)
        if config.trust_remote_code:
            logger.warning(
                "--trust-remote-code: accepted, but no code from the model folder is run; "
                "tokenmill implements each architecture itself"
            )
        self.tokenizer = Tokenizer.from_pretrained(
            resolve_model_path(config.tokenizer) if config.tokenizer else self.model_path
        )
        mc = self.model_config
        self.device = resolve_device(config.device)
        num_threads = config.num_threads or default_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads)
            logger.info(
                "CPU: %s; %d compute threads (%s)",
                cpu_info().describe(),
                num_threads,
                "--num-threads"
                if config.num_threads
                else "one per physical core; --num-threads overrides",
            )
        self.dtype = resolve_dtype(config.dtype, mc, self.device, config.quantization)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.config = config = replace(
            config,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),  # type: ignore[arg-type]
            max_model_len=config.max_model_len or mc.max_position_embeddings,
            num_threads=num_threads,
            kv_cache_dtype=KV_CACHE_DTYPE_NAMES[self.kv_dtype],  # type: ignore[arg-type]
        )
        """The resolved config: no ``auto`` device or dtype, and the model's context length filled in."""
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        eos = set(mc.eos_token_ids) | _generation_eos_ids(self.model_path)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.pooler_config: PoolerConfig | None = None
        """How pooling requests pool (``--runner pooling``): what the checkpoint declares."""
        if config.is_pooling:
            try:
                self.pooler_config = PoolerConfig.from_folder(self.model_path)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            logger.info(
                "runner pooling: %s pooling%s, from %s",
                self.pooler_config.pooling_type.lower(),
                ", normalised" if self.pooler_config.normalize else "",
                self.pooler_config.source,
            )

        model = load_model(
            self.model_path,
            self.dtype,
            self.device,
            self.max_model_len,
            mc,
            quantization=config.quantization,
            group_size=config.quantization_group_size,
        )
        kv_start = time.monotonic()
        self.startup = StartupCosts(model_load_s=kv_start - start)
        """What this start cost per phase (model load, KV allocation, compile per bucket)."""
        self.kv_manager, kv_caches = self._build_kv_cache()
        self.startup.kv_allocation_s = time.monotonic() - kv_start
        step_budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill and step_budget < self.max_model_len:
            step_budget = self.max_model_len  # a whole prompt must fit one step
            logger.info(
                "--no-enable-chunked-prefill: the step budget is %d tokens (--max-model-len), "
                "so any prompt can be prefilled in one step",
                step_budget,
            )
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_seqs,
            step_budget,
            config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else None,
            enable_chunked_prefill=config.enable_chunked_prefill,
            draft_model=config.speculative is not None
            and config.speculative.method == "draft_model",
        )
        lora = None
        if config.enable_lora:
            lora = LoRAManager(
                mc,
                config.max_loras,
                config.max_cpu_loras or config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
                ids_in_use=lambda: {r.lora_id for r in self.scheduler.requests.values()},
            )
            logger.info(
                "LoRA: %d slot(s) of rank %d (%.1f MiB)",
                config.max_loras,
                config.max_lora_rank,
                lora.stacks.nbytes / 2**20,
            )
        self._lora_removals: set[int] = set()
        """Adapters unloaded while requests still ran on them: dropped when the last ends."""
        self._removed_lora_ids: set[int] = set()
        """Unloaded adapter ids: a request naming one (sent before the unload) is refused."""
        self._failures: dict[str, RequestFailedError] = {}
        """Requests aborted because their own sampling or bookkeeping raised (per request id)."""
        compiled = None
        if (
            self.kv_manager.wants_compiled_decode
            and not config.is_pooling  # pooling never decodes
            and not config.enforce_eager
            and self._can_compile()
            and self._model_compiles(model)
        ):
            compiled = CompiledDecodeStep(
                model,
                kv_caches,
                self.kv_manager.block_size,
                max_blocks_per_seq=-(-self.max_model_len // self.kv_manager.block_size),
                scratch_block=self.kv_manager.num_blocks,
                buckets=_with_verify_bucket(
                    config,
                    list(
                        config.compile_batch_sizes
                        or default_buckets(config.max_num_seqs, self.device)
                    ),
                ),
                device=self.device,
            )
        self.runner = ModelRunner(
            model,
            kv_caches,
            self.kv_manager.block_size,
            Sampler(self.device, config.seed),
            self.device,
            compiled,
            lora,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(
            self.tokenizer,
            InputLimits(
                vocab_size=mc.vocab_size,
                max_model_len=self.max_model_len,
                kv_capacity_tokens=self.kv_manager.max_tokens_per_request,
                max_logprobs=config.max_logprobs,
                scheduling_policy=config.scheduling_policy,
                eos_token_ids=self.eos_token_ids,
                enable_prefix_caching=config.enable_prefix_caching,
                enable_lora=config.enable_lora,
                supports_beam_search=self.kv_manager.supports_fork,
                max_num_seqs=config.max_num_seqs,
            ),
            GrammarCompiler(self.tokenizer.backend.to_str(), mc.vocab_size, self.eos_token_ids),
        )
        self.speculative = config.speculative
        """Speculative decoding's config; None: one token per request per step."""
        self.drafter: DraftProposer | None = None
        """The draft model (method draft_model); None for n-gram or no speculation."""
        if self.speculative is not None:
            self._check_speculation()
        self.beam_search = BeamSearchCoordinator(
            self.scheduler,
            self.tokenizer,
            BeamLimits(
                max_active_requests=config.max_beam_search_requests,
                max_num_seqs=config.max_num_seqs,
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=min(self.max_model_len, self.kv_manager.max_tokens_per_request),
                enable_prefix_caching=config.enable_prefix_caching,
            ),
        )
        self._counters = EngineStats(
            compile_time_s=compiled.compile_time_s if compiled else 0.0,
            kv_capacity_tokens=self.kv_manager.num_blocks * self.kv_manager.block_size,
            precision={
                "dtype": config.dtype,
                "quantization": config.quantization or "none",
                "kv_cache_dtype": config.kv_cache_dtype,
                "num_threads": str(num_threads) if self.device.type == "cpu" else "n/a",
                "cpu_isa": cpu_info().isa if self.device.type == "cpu" else "n/a",
            },
            cache_config={  # vLLM's CacheConfig names
                "block_size": str(self.kv_manager.block_size),
                "cache_dtype": config.kv_cache_dtype,
                "enable_prefix_caching": str(config.enable_prefix_caching),
                "gpu_memory_utilization": str(config.gpu_memory_utilization),
                "num_gpu_blocks": str(self.kv_manager.num_blocks),
                "num_cpu_blocks": "None",
                "prefix_caching_hash_algo": "sha256",
                "kv_cache": config.kv_cache,
            },
        )
        if compiled is not None:
            self.startup.compile_s_by_bucket = dict(compiled.compile_s_by_bucket)
            self.startup.compile_cache_by_bucket = dict(compiled.cache_by_bucket)
        if self.kv_dtype in FP8_DTYPES:
            self._calibrate_kv_scales()
        self.startup_time_s = time.monotonic() - start
        self.startup.total_s = self.startup_time_s
        logger.info(
            "loaded %s (%s, %.1fM params) on %s in %s%s; KV (%s): %d tokens in %d blocks of %d (%.2f GiB); ready in %.1fs",
            self.model_path,
            mc.architecture,
            mc.num_params / 1e6,
            self.device,
            self.dtype,
            f", {config.quantization} weights" if config.quantization else "",
            config.kv_cache_dtype,
            self.kv_manager.num_blocks * self.kv_manager.block_size,
            self.kv_manager.num_blocks,
            self.kv_manager.block_size,
            self.kv_cache_bytes / 2**30,
            self.startup_time_s,
        )
        logger.info(
            "start-up costs: model load %.2fs, KV allocation %.2fs, compile %.2fs (%d buckets, cache %s)",
            self.startup.model_load_s,
            self.startup.kv_allocation_s,
            self.startup.compile_s,
            len(self.startup.compile_s_by_bucket),
            self.startup.compile_cache,
        )

    # ---- construction ------------------------------------------------------------------
    def _build_kv_cache(self) -> tuple[KVCacheManager, list[tuple[torch.Tensor, torch.Tensor]]]:
        cfg = self.config
        block_size = cfg.block_size
        per_token = kv_bytes_per_token(self.model_config, self.kv_dtype)
        budget = kv_budget_bytes(cfg.kv_cache_memory, cfg.gpu_memory_utilization, self.device)
        manager = build_kv_manager(
            cfg.kv_cache,
            KVSizing(
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=block_size,
                enable_prefix_caching=cfg.enable_prefix_caching,
                budget_bytes=budget,
                bytes_per_token=per_token,
            ),
        )
        self.kv_cache_bytes = manager.num_blocks * block_size * per_token
        caches = allocate_kv_cache(
            self.model_config, manager.num_blocks, block_size, self.kv_dtype, self.device
        )
        return manager, caches

    def _check_speculation(self) -> None:
        spec = self.speculative
        assert spec is not None
        if spec.method == "draft_model":
            self.drafter = self._load_draft(spec)
        if self.config.is_pooling:
            raise ConfigError(
                "--speculative-config: a pooling runner generates nothing to speculate on"
            )
        logger.info(
            "speculative decoding: %s, %d tokens per step, off above %d running requests",
            spec.method,
            spec.num_speculative_tokens,
            spec.max_batch_size,
        )

    def _load_draft(self, spec: SpeculativeConfig) -> DraftProposer:
        """The draft model, with KV tensors in the target's block layout (model dtype)."""
        assert spec.model is not None
        folder = resolve_model_path(spec.model)
        try:
            draft_config = ModelConfig.from_folder(folder)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--speculative-config: draft model {spec.model!r}: {exc}") from None
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ConfigError(
                f"--speculative-config: the draft's vocabulary ({draft_config.vocab_size}) is not "
                f"the target's ({self.model_config.vocab_size}): they must share a tokenizer"
            )
        model = load_model(folder, self.dtype, self.device, self.max_model_len, draft_config)
        caches = allocate_kv_cache(
            draft_config,
            self.kv_manager.num_blocks,
            self.kv_manager.block_size,
            self.dtype,
            self.device,
        )
        logger.info(
            "speculative decoding: draft %s (%.1fM params), its KV in the target's blocks (%.2f GiB)",
            folder,
            draft_config.num_params / 1e6,
            sum(k.nbytes + v.nbytes for k, v in caches) / 2**30,
        )
        return DraftProposer.build(model, caches, self.kv_manager.block_size, self.device)

    def _model_compiles(self, model: CausalLM) -> bool:
        """False for models whose forward cannot be compiled with fixed shapes (MoE routing,
        the Transformers fallback)."""
        if not model.supports_compiled_decode:
            logger.info(
                "static: %s runs the decode step eagerly (%s)",
                self.model_config.architecture,
                model.eager_reason,
            )
        return model.supports_compiled_decode

    def _can_compile(self) -> bool:
        """False for the one combination whose compiled decode step was seen to be wrong.

        With half-precision activations, int8/int4 weights and an fp8 KV cache together,
        inductor's decode step produced garbage tokens on AVX2 kernels (seen with ATen and
        oneDNN held to AVX2 on an AVX-512 machine; each pair of the three compiled fine).
        That combination runs the static strategy eagerly there, with a warning.
        """
        cfg = self.config
        is_suspect = (
            self.device.type == "cpu"
            and cpu_info().isa != "AVX512"
            and cfg.quantization is not None
            and self.kv_dtype in FP8_DTYPES
            and self.dtype != torch.float32
        )
        if is_suspect:
            logger.warning(
                "static: running the decode step eagerly: %s activations with %s weights and an "
                "%s KV cache compiled to wrong results on %s kernels",
                cfg.dtype,
                cfg.quantization,
                cfg.kv_cache_dtype,
                cpu_info().isa,
            )
        return not is_suspect

    def _calibrate_kv_scales(self) -> None:
        """Set every layer's fp8 KV scales from one fixed prompt, before any request.

        The first K/V a layer writes sets its scales; writing a fixed text first makes them,
        and so every output, the same from one start to the next whatever arrives first.
        """
        text = " ".join(["The quick brown fox jumps over the lazy dog, 0123456789."] * 8)
        ids = self.tokenizer.encode(text)[: max(1, min(64, self.max_model_len - 1))]
        self.add_request("__kv_scale_calibration__", ids, SamplingParams(max_tokens=1))
        while self.has_unfinished_requests():
            self.step()
        self.kv_manager.reset_prefix_cache()
        self._counters = replace(
            EngineStats(),
            compile_time_s=self._counters.compile_time_s,
            kv_capacity_tokens=self._counters.kv_capacity_tokens,
            precision=self._counters.precision,
        )

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Check and queue a request; a text prompt is tokenized here, token ids are taken as they are."""
        self.add_processed(
            self.input_processor.process(
                request_id, prompt, params, priority, arrival_time, lora_request
            )
        )

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Queue a request the input processor already checked (its adapter is loaded here)."""
        if self.output_processor.has_request(processed.request_id) or self.beam_search.has_request(
            processed.request_id
        ):
            raise InvalidRequestError(
                f"request id {processed.request_id!r} is already in use", param="request_id"
            )
        if (processed.pooling is not None) != self.config.is_pooling:
            raise InvalidRequestError(
                "this engine pools (--runner pooling): it takes pooling requests only"
                if self.config.is_pooling
                else "pooling requests need an engine started with --runner pooling",
                param="model",
            )
        if processed.params.use_beam_search:
            if self.speculative is not None:
                raise InvalidRequestError(
                    "beam search is not supported with speculative decoding (--speculative-config)",
                    param="use_beam_search",
                )
            if processed.lora_request is not None:
                raise InvalidRequestError(
                    "beam search on a LoRA adapter is not supported", param="use_beam_search"
                )
            self.beam_search.add(processed)
            return
        if processed.lora_request is not None:
            self.add_lora(processed.lora_request)
        children = self.input_processor.fan_out(processed)
        self.output_processor.add_request(processed.request_id, processed.prompt_text, children)
        for child in children:
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests wherever they are; their KV is freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if self.beam_search.abort(rid):
                continue
            for child_id in self.output_processor.child_ids(rid):
                if (
                    self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
                    is not None
                ):
                    self.output_processor.mark_finished(child_id)

    # ---- LoRA adapters ---------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter (if not loaded yet); LoRAError names what does not fit the model."""
        if self.runner.lora is None:
            raise InvalidRequestError(
                "a LoRA adapter needs the engine to run with --enable-lora", param="lora_request"
            )
        if lora_request.lora_int_id in self._removed_lora_ids:
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r} was unloaded", param="model"
            )
        self.runner.lora.add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter. Its running and waiting requests finish with it first; new
        requests naming its id are refused. False if it was not loaded."""
        lora = self.runner.lora
        self._removed_lora_ids.add(lora_id)  # also when never loaded: one may be on its way
        if lora is None or lora.get(lora_id) is None:
            return False
        self._lora_removals.add(lora_id)
        self._drop_unused_loras()
        return True

    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded now."""
        return self.runner.lora.ids() if self.runner.lora is not None else []

    def _drop_unused_loras(self) -> None:
        if not self._lora_removals or self.runner.lora is None:
            return
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        for lora_id in self._lora_removals - in_use:
            self.runner.lora.remove(lora_id)
            self._lora_removals.discard(lora_id)

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one request can hold in the KV cache."""
        return self.kv_manager.max_tokens_per_request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.beam_search.has_unfinished

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that changed.

        The error boundary is per request: what raises while sampling, scoring or
        post-processing one request aborts that request alone (``take_failures`` says
        which); only a failure of the batch's forward itself escapes."""
        self.beam_search.admit()
        if self.speculative is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if self.drafter is not None:  # fills the draft slots the scheduler granted
            self.drafter.propose(sched)
        result = self.runner.execute(sched)
        self.scheduler.update_after_step(sched.scheduled)
        now = time.monotonic()
        stats = self._counters
        self._record_kv_footprint(stats)
        for rid, step_error in result.failed.items():
            self._fail(rid, step_error)
        for request, _ in sched.scheduled:
            if request.status is RequestStatus.FINISHED_ABORTED:
                continue  # its request failed (and was aborted) during this step
            try:
                self._on_step_result(request, result, now, stats)
            except Exception as exc:
                self._fail(request.request_id, exc)
        stats.num_steps += 1
        if sched.total_num_tokens:
            stats.observe_iteration(sched.total_num_tokens)
        self._drop_unused_loras()
        outputs = self.output_processor.collect() + self.beam_search.advance()
        for rid, search_error in self.beam_search.take_failures().items():
            self._fail(rid, search_error)
        if self._failures:
            outputs = [o for o in outputs if o.request_id not in self._failures]
        return outputs

    def _on_step_result(
        self, request: Request, result: StepOutput, now: float, stats: EngineStats
    ) -> None:
        """Fold one scheduled request's logprobs and sampled token into its state."""
        rid = request.request_id
        if rid in result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(rid, *result.prompt_logprobs[rid])
        pooled = result.pooled.get(rid)
        if pooled is not None:  # a pooling request ends with its prompt
            request.metrics.first_token_time = request.metrics.last_token_time = now
            stats.num_prompt_tokens += request.num_prompt_tokens
            self.output_processor.set_pooled(rid, pooled)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            self.output_processor.mark_finished(rid)
            return
        token = result.sampled.get(rid)
        if token is None:
            return
        if rid in result.verified:
            self._on_verified(request, result.verified[rid], result, now, stats)
            return
        stats.num_generation_tokens += 1
        if self.beam_search.owns(rid):  # the search picks the beams' tokens
            if request.num_output_tokens == 0 and request.metrics.first_token_time is None:
                request.metrics.first_token_time = now  # the prompt, prefilled once
                stats.num_prompt_tokens += request.num_prompt_tokens
            self.beam_search.on_logprobs(request, result.logprobs.get(rid))
            return
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
            if request.index == 0:  # n > 1 samples share one prompt
                stats.num_prompt_tokens += request.num_prompt_tokens
        request.metrics.last_token_time = now
        status = request.append_output_token(token)
        stop = self.output_processor.on_token(rid, token, result.logprobs.get(rid))
        if stop is not None:
            request.stop_reason = stop
            status = RequestStatus.FINISHED_STOPPED
        if status is None and rid in result.grammar_ended:
            status = RequestStatus.FINISHED_STOPPED  # nothing more can satisfy its grammar
        if status is not None:
            self.scheduler.finish_request(rid, status)
            self.output_processor.mark_finished(rid)

    # ---- speculative decoding ----------------------------------------------------------
    def _propose(self) -> None:
        """Draft tokens for running requests about to decode, as many as the policy allows
        for this batch size. Beams decode without them."""
        spec = self.speculative
        assert spec is not None
        k = num_tokens_to_propose(spec, self.scheduler.num_running)
        if self.scheduler.num_running:
            steps = self._counters.spec_policy_steps
            steps[k] = steps.get(k, 0) + 1
        for request in self.scheduler.running:
            request.spec_token_ids = []
            if (
                k == 0
                or request.is_beam
                or request.pooling is not None
                or request.num_computed_tokens != request.num_tokens - 1
            ):
                continue
            if self.drafter is not None:  # slots now, the draft's tokens once scheduled
                request.spec_token_ids = [0] * min(k, max_draft_tokens(request))
            else:
                request.spec_token_ids = propose_ngram(spec, request, k)

    def _on_verified(
        self,
        request: Request,
        verified: VerifiedTokens,
        result: StepOutput,
        now: float,
        stats: EngineStats,
    ) -> None:
        """Append the tokens verification kept, one at a time, until one of them finishes
        the request (EOS, stop strings, max_tokens cut the run); then roll back the KV of
        the rejected ones."""
        rid = request.request_id
        stats.record_speculation(verified.num_draft_tokens, verified.num_accepted)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        status: RequestStatus | None = None
        for token, logprobs in zip(verified.token_ids, verified.logprobs, strict=True):
            stats.num_generation_tokens += 1
            status = request.append_output_token(token)
            stop = self.output_processor.on_token(rid, token, logprobs)
            if stop is not None:
                request.stop_reason = stop
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                break
        if status is None and rid in result.grammar_ended:
            status = RequestStatus.FINISHED_STOPPED  # nothing more can satisfy its grammar
        if status is not None:
            self.scheduler.finish_request(rid, status)
            self.output_processor.mark_finished(rid)
            return
        self.scheduler.rollback_unverified(request)

    def _user_request_id(self, sequence: Request | str) -> str:
        """The user request a scheduler sequence (a sample of n, or a beam) belongs to."""
        sid = sequence if isinstance(sequence, str) else sequence.request_id
        return self.beam_search.owner_of(sid) or self.output_processor.parent_id(sid) or sid

    def _fail(self, sequence_id: str, exc: Exception) -> None:
        """Abort the user request a sequence belongs to, because that sequence raised."""
        rid = self._user_request_id(sequence_id)
        if rid in self._failures:
            return
        logger.error(
            "request %s failed in the engine step and was aborted; other requests go on: %r",
            rid,
            exc,
            exc_info=exc,
        )
        self._failures[rid] = RequestFailedError(rid)
        self.abort_request(rid)

    def take_failures(self) -> dict[str, RequestFailedError]:
        """Requests aborted since the last call because their own processing raised."""
        failures, self._failures = self._failures, {}
        return failures

    def _record_kv_footprint(self, stats: EngineStats) -> None:
        """KV reserved vs holding tokens right after this step's writes (before frees)."""
        reserved = self.kv_manager.num_reserved_token_slots
        # Shared prefix blocks count once in ``reserved`` but per request here, so cap it.
        used = min(sum(r.num_computed_tokens for r in self.scheduler.running), reserved)
        stats.kv_reserved_tokens, stats.kv_used_tokens = reserved, used
        stats.kv_reserved_token_steps += reserved
        stats.kv_used_token_steps += used

    @property
    def stats(self) -> EngineStats:
        """Counters plus gauges read now; a copy, safe to hand to another thread."""
        return replace(
            self._counters,
            spec_accepted_per_pos=list(self._counters.spec_accepted_per_pos),
            spec_policy_steps=dict(self._counters.spec_policy_steps),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + self.beam_search.num_queued,
            kv_usage=self.kv_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_query_tokens=self.kv_manager.stats.num_query_tokens,
            num_prefix_hit_tokens=self.kv_manager.stats.num_hit_tokens,
            moe_tokens_per_expert=self.runner.model.debug_stats().get("moe_tokens_per_expert", []),
        )
