"""LLMEngine: the synchronous core loop tying scheduler, runner and output processor.

Data flows one way each ``step()``: scheduler -> model runner (forward + sampler) ->
request state update -> output processor -> RequestOutputs. Everything a caller does
(add, abort, step) happens on one thread; the async server wraps this object.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.core.kv import KVCacheManager, KVSizing, build_kv_manager
from tokenmill.core.messages import CacheInfo, KVCacheSpec, StepOutput, VerifiedTokens, WorkerInfo
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.speculative import max_draft_tokens, num_tokens_to_propose
from tokenmill.core.stats import EngineStats, StartupCosts
from tokenmill.engine.beam_search import BeamLimits, BeamSearchCoordinator
from tokenmill.engine.input_processor import InputLimits, InputProcessor, ProcessedRequest
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.startup import initial_stats, log_ready
from tokenmill.errors import ConfigError, InvalidRequestError, RequestFailedError
from tokenmill.executor import Executor, build_executor, check_tensor_parallel
from tokenmill.lora_request import LoRARequest
from tokenmill.model.dtypes import KV_CACHE_DTYPES, resolve_device
from tokenmill.model.registry import resolve_model_impl
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolerConfig
from tokenmill.resolved_model import ResolvedModel, resolve_model
from tokenmill.structured.grammar import GrammarCompiler

if TYPE_CHECKING:
    from tokenmill.executor import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine"]


class LLMEngine:
    """Loads a model and serves many requests at once with continuous batching."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None) -> None:
        """``resolved``: the model as the caller already resolved it (a server resolves it
        for its start-up checks); else it is resolved here."""
        start = time.monotonic()
        self.config = config
        self.resolved = resolved = resolved or resolve_model(config)
        """The model's folder, config, tokenizer and EOS ids: the workers get this same one."""
        self.model_path = resolved.model_path
        self.model_config = mc = resolved.model_config
        _, impl_reason = resolve_model_impl(mc.architecture, config.model_impl)
        logger.info("model implementation: %s (%s)", mc.model_impl, impl_reason)
        if mc.model_impl == "transformers":
            from tokenmill.model.transformers_fallback import check_features

            check_features(config.quantization, config.enable_lora)
        if config.trust_remote_code:
            logger.warning(
                "--trust-remote-code: accepted, but no code from the model folder is run; "
                "tokenmill implements each architecture itself"
            )
        self.speculative = config.speculative
        """Speculative decoding's config; None: one token per request per step."""
        if self.speculative is not None and config.is_pooling:
            raise ConfigError(
                "--speculative-config: a pooling runner generates nothing to speculate on"
            )
        self.tokenizer = resolved.tokenizer
        check_tensor_parallel(config, mc)
        self.executor: Executor = build_executor(config, resolved)
        """How the engine reaches its workers (the only way it does)."""
        info: WorkerInfo = self.executor.collective_rpc("describe", result_type=WorkerInfo)[0]
        self.config = config = replace(
            config,
            device=info.device,
            dtype=info.dtype,  # type: ignore[arg-type]
            max_model_len=info.max_model_len,
            num_threads=info.num_threads,
            kv_cache_dtype=info.kv_cache_dtype,  # type: ignore[arg-type]
            max_num_batched_tokens=config.step_token_budget(resolve_device(info.device).type),
        )
        """The resolved config: no ``auto`` device or dtype, the model's context length and the
        device's step budget filled in."""
        self.device = resolve_device(info.device)
        self.dtype = KV_CACHE_DTYPES[info.dtype]
        self.kv_dtype = KV_CACHE_DTYPES[info.kv_cache_dtype]
        self.max_model_len: int = info.max_model_len
        self.eos_token_ids = resolved.eos_token_ids
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
        kv_start = time.monotonic()
        self.startup = StartupCosts(model_load_s=kv_start - start)
        """What this start cost per phase (model load, KV allocation, compile per bucket)."""
        self.kv_manager = self._build_kv_manager()
        cache: CacheInfo = self.executor.collective_rpc(
            "initialize_cache",
            (
                KVCacheSpec(
                    self.kv_manager.num_blocks,
                    self.kv_manager.block_size,
                    self.kv_manager.wants_compiled_decode or config.compile_batch_sizes is not None,
                ),
            ),
            result_type=CacheInfo,
        )[0]
        self.kv_cache_bytes = cache.kv_cache_bytes
        if cache.eager_reason is not None:
            logger.info(
                "%s: %s runs the decode step eagerly (%s)",
                config.kv_cache,
                mc.architecture,
                cache.eager_reason,
            )
        self.startup.kv_allocation_s = time.monotonic() - kv_start - cache.compile_time_s
        step_budget = config.step_token_budget(self.device.type)  # filled in above
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
            draft_model=config.speculative is not None and config.speculative.charges_budget,
        )
        self._lora_removals: set[int] = set()
        """Adapters unloaded while requests still ran on them: dropped when the last ends."""
        self._removed_lora_ids: set[int] = set()
        """Unloaded adapter ids: a request naming one (sent before the unload) is refused."""
        self._failures: dict[str, RequestFailedError] = {}
        """Requests aborted because their own sampling or bookkeeping raised (per request id)."""
        self.output_processor = OutputProcessor(self.tokenizer)
        limits = InputLimits(
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
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            limits,
            GrammarCompiler(self.tokenizer.backend.to_str(), mc.vocab_size, self.eos_token_ids),
        )
        if self.speculative is not None:
            logger.info(
                "speculative decoding: %s, %d tokens per step, off above %d running requests",
                self.speculative.method,
                self.speculative.num_speculative_tokens,
                self.speculative.max_batch_size,
            )
        self.beam_search = BeamSearchCoordinator(
            self.scheduler,
            self.tokenizer,
            BeamLimits(
                max_active_requests=config.max_beam_search_requests,
                max_num_seqs=config.max_num_seqs,
                eos_token_ids=self.eos_token_ids,
                max_total_tokens=limits.max_total_tokens,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
        )
        self._counters = initial_stats(config, self.kv_manager, cache.compile_time_s)
        self.startup.compile_s_by_bucket = dict(cache.compile_s_by_bucket)
        self.startup.compile_cache_by_bucket = dict(cache.compile_cache_by_bucket)
        if config.kv_cache_dtype.startswith("fp8"):
            self._calibrate_kv_scales()
        self.startup_time_s = time.monotonic() - start
        self.startup.total_s = self.startup_time_s
        log_ready(config, mc, self.model_path, self.kv_manager, self.kv_cache_bytes, self.startup)

    # ---- construction ------------------------------------------------------------------
    def _build_kv_manager(self) -> KVCacheManager:
        """Sized for the tightest rank: the smallest budget over the largest bytes per token."""
        cfg = self.config
        infos = self.executor.collective_rpc("kv_cache_info", result_type=tuple[int, int])
        return build_kv_manager(
            cfg.kv_cache,
            KVSizing(
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=cfg.block_size,
                enable_prefix_caching=cfg.enable_prefix_caching,
                budget_bytes=min(budget for _, budget in infos),
                bytes_per_token=max(per_token for per_token, _ in infos),
                prefix_cache_fills_pool=cfg.prefix_cache_fills_pool,
            ),
        )

    def shutdown(self) -> None:
        """Stop the workers (their processes, with the mp executor)."""
        self.executor.shutdown()

    def check_health(self) -> None:
        """Raise WorkerDiedError (naming the rank) if a worker process is gone."""
        self.executor.check_health()

    @property
    def runner(self) -> ModelRunner:
        """The in-process worker's runner (tests and scoring reach the model through it)."""
        return self.executor.runner

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
        cache_salt: str | None = None,
    ) -> None:
        """Check and queue a request; a text prompt is tokenized here, token ids are taken as they are.

        Only requests with the same ``cache_salt`` (vLLM's prompt field) reuse each other's
        prefix-cache blocks."""
        self.add_processed(
            self.input_processor.process(
                request_id, prompt, params, priority, arrival_time, lora_request, cache_salt
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
        if not self.config.enable_lora:
            raise InvalidRequestError(
                "a LoRA adapter needs the engine to run with --enable-lora", param="lora_request"
            )
        if lora_request.lora_int_id in self._removed_lora_ids:
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r} was unloaded", param="model"
            )
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        self.executor.collective_rpc("add_lora", (lora_request, in_use))

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter. Its running and waiting requests finish with it first; new
        requests naming its id are refused. False if it was not loaded."""
        self._removed_lora_ids.add(lora_id)  # also when never loaded: one may be on its way
        if (
            not self.config.enable_lora
            or not self.executor.collective_rpc("has_lora", (lora_id,))[0]
        ):
            return False
        self._lora_removals.add(lora_id)
        self._drop_unused_loras()
        return True

    def list_loras(self) -> list[int]:
        """Ids of the adapters loaded now."""
        ids: list[int] = self.executor.collective_rpc("list_loras")[0]
        return ids

    def _drop_unused_loras(self) -> None:
        if not self._lora_removals:
            return
        in_use = {r.lora_id for r in self.scheduler.requests.values()}
        for lora_id in self._lora_removals - in_use:
            self.executor.collective_rpc("remove_lora", (lora_id,))
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
        max_proposal = self._ask_for_drafts() if self.speculative is not None else 0
        sched = self.scheduler.schedule()
        sched.plan.max_proposal = max_proposal
        if sched.draft_catch_up:
            self._counters.record_draft_model_step(sched.num_draft_model_tokens)
        result = self.executor.execute_model(sched.plan)
        requests = self.scheduler.requests
        for rid, num in result.num_draft_computed.items():  # the worker's draft KV length
            requests[rid].num_draft_computed_tokens = num
        if self.speculative is not None:
            for rid in result.sampled:  # what the proposer has ready for the next step
                if rid in requests:
                    requests[rid].num_proposable = result.num_proposable.get(rid, 0)
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
    def _ask_for_drafts(self) -> int:
        """Draft tokens for running requests about to decode: as many as the policy allows
        for this batch size, the request may still produce, and the workers' proposer has
        ready (a count; the tokens stay on the workers). Beams decode without them. Returns
        the policy's k, which the proposer prepares for the step after.

        The batch size counts waiting requests too (up to ``max_num_seqs``): they are
        admitted in this very step or soon, and a draft reading prompts now would only take
        budget from their prefills (at 16 arriving streams the first few used to speculate,
        their draft reading whole prompts, while the rest waited for their first token)."""
        spec = self.speculative
        assert spec is not None
        sched = self.scheduler
        batch = min(sched.max_num_seqs, sched.num_running + sched.num_waiting)
        k = num_tokens_to_propose(spec, batch)
        if self.scheduler.num_running:
            steps = self._counters.spec_policy_steps
            steps[k] = steps.get(k, 0) + 1
        for request in self.scheduler.running:
            request.num_spec_tokens = 0
            if (
                k == 0
                or request.is_beam
                or request.pooling is not None
                or request.num_computed_tokens != request.num_tokens - 1
            ):
                continue
            request.num_spec_tokens = min(k, max_draft_tokens(request), request.num_proposable)
        return k

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

    def _fail(self, sequence_id: str, exc: Exception | str) -> None:
        """Abort the user request a sequence belongs to, because that sequence raised
        (here, or in a worker: then ``exc`` is the worker's traceback as text)."""
        rid = self._user_request_id(sequence_id)
        if rid in self._failures:
            return
        logger.error(
            "request %s failed in the engine step and was aborted; other requests go on: %s",
            rid,
            exc if isinstance(exc, str) else repr(exc),
            exc_info=None if isinstance(exc, str) else exc,
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
        worker_stats = self.executor.collective_rpc("debug_stats")
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
            moe_tokens_per_expert=worker_stats[0].get("moe_tokens_per_expert", []),
            kv_cache_resident_bytes=sum(s.get("kv_cache_resident_bytes", 0) for s in worker_stats),
        )
