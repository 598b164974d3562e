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
from tokenmill.core.request import RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.stats import EngineStats
from tokenmill.engine.input_processor import InputLimits, InputProcessor, ProcessedRequest
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import InvalidRequestError
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_model, resolve_dtype
from tokenmill.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.sampler import Sampler
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.tokenizer.tokenizer import Tokenizer
from tokenmill.worker.compiled_step import CompiledDecodeStep, default_buckets
from tokenmill.worker.kv_cache import allocate_kv_cache, kv_budget_bytes, kv_bytes_per_token
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def resolve_model_path(model: str) -> Path:
    """``demo`` means the built-in demo model (built on first use)."""
    if model == "demo":
        from tokenmill.model.demo import demo_model_path

        return demo_model_path()
    return Path(model)


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


class LLMEngine:
    """Loads a model and serves many requests at once with continuous batching."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_folder(self.model_path)
        if config.rope_theta_override is not None:
            self.model_config = replace(self.model_config, rope_theta=config.rope_theta_override)
        self.tokenizer = Tokenizer.from_pretrained(self.model_path)
        mc = self.model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        self.config = config = replace(
            config,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),  # type: ignore[arg-type]
            max_model_len=config.max_model_len or mc.max_position_embeddings,
        )
        """The resolved config: no ``auto`` device or dtype, and the model's context length filled in."""
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        eos = set(mc.eos_token_ids) | _generation_eos_ids(self.model_path)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

        model = load_model(self.model_path, self.dtype, self.device, self.max_model_len, mc)
        self.kv_manager, kv_caches = self._build_kv_cache()
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
        )
        compiled = None
        if self.kv_manager.wants_compiled_decode and not config.enforce_eager:
            compiled = CompiledDecodeStep(
                model,
                kv_caches,
                self.kv_manager.block_size,
                max_blocks_per_seq=-(-self.max_model_len // self.kv_manager.block_size),
                scratch_block=self.kv_manager.num_blocks,
                buckets=list(
                    config.compile_batch_sizes or default_buckets(config.max_num_seqs, self.device)
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
            ),
            GrammarCompiler(self.tokenizer.backend.to_str(), mc.vocab_size, self.eos_token_ids),
        )
        self._counters = EngineStats(
            compile_time_s=compiled.compile_time_s if compiled else 0.0,
            kv_capacity_tokens=self.kv_manager.num_blocks * self.kv_manager.block_size,
        )
        self.startup_time_s = time.monotonic() - start
        logger.info(
            "loaded %s (%s, %.1fM params) on %s in %s; KV: %d blocks of %d tokens (%.2f GiB); ready in %.1fs",
            self.model_path,
            mc.architecture,
            mc.num_params / 1e6,
            self.device,
            self.dtype,
            self.kv_manager.num_blocks,
            self.kv_manager.block_size,
            self.kv_cache_bytes / 2**30,
            self.startup_time_s,
        )

    # ---- construction ------------------------------------------------------------------
    def _build_kv_cache(self) -> tuple[KVCacheManager, list[tuple[torch.Tensor, torch.Tensor]]]:
        cfg = self.config
        block_size = cfg.block_size
        per_token = kv_bytes_per_token(self.model_config, self.dtype)
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
            self.model_config, manager.num_blocks, block_size, self.dtype, self.device
        )
        return manager, caches

    # ---- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Check and queue a request; a text prompt is tokenized here, token ids are taken as they are."""
        self.add_processed(
            self.input_processor.process(request_id, prompt, params, priority, arrival_time)
        )

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Queue a request the input processor already checked (nothing is checked again)."""
        if self.output_processor.has_request(processed.request_id):
            raise InvalidRequestError(
                f"request id {processed.request_id!r} is already in use", param="request_id"
            )
        children = self.input_processor.fan_out(processed)
        self.output_processor.add_request(processed.request_id, processed.prompt_text, children)
        for child in children:
            self.scheduler.add_request(child)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests wherever they are; their KV is freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for child_id in self.output_processor.child_ids(rid):
                if (
                    self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
                    is not None
                ):
                    self.output_processor.mark_finished(child_id)

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens one request can hold in the KV cache."""
        return self.kv_manager.max_tokens_per_request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and return outputs of requests that changed."""
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        self.scheduler.update_after_step(sched.scheduled)
        now = time.monotonic()
        stats = self._counters
        self._record_kv_footprint(stats)
        for request, _ in sched.scheduled:
            rid = request.request_id
            if rid in result.prompt_logprobs:
                self.output_processor.add_prompt_logprobs(rid, *result.prompt_logprobs[rid])
            token = result.sampled.get(rid)
            if token is None:
                continue
            stats.num_generation_tokens += 1
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
        stats.num_steps += 1
        return self.output_processor.collect()

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
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.kv_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_query_tokens=self.kv_manager.stats.num_query_tokens,
            num_prefix_hit_tokens=self.kv_manager.stats.num_hit_tokens,
        )
