"""Worker: one rank's device, threads, dtype, model, KV tensors, compiled step and proposer.

The engine never touches these: it reaches a worker through an executor (``executor/``),
in this process or in another one, with the same calls: ``describe`` (what was resolved),
``kv_cache_info`` (bytes per token and the memory budget), ``initialize_cache`` (allocate
the KV tensors the engine's KV manager sized, compile the decode step, load the draft
model and LoRA slots), ``execute_model`` (one step's diff in, what it produced out) and the
LoRA calls. Start-up order is vLLM's: load, report memory, allocate what the scheduler side
decided. Pooling runs in the same runner (``ModelRunner._pool``); fp8 KV scales are set by
the engine running one fixed prompt through ``execute_model`` before any request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.messages import CacheInfo, KVCacheSpec, StepOutput, StepPlan, WorkerInfo
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.speculative import max_verify_rows
from tokenmill.errors import ConfigError
from tokenmill.lora_request import LoRARequest
from tokenmill.model import thread_policy
from tokenmill.model.attention import FP8_DTYPES
from tokenmill.model.attention_backend import select_attention_backend
from tokenmill.model.base import CausalLM
from tokenmill.model.config import ModelConfig
from tokenmill.model.cpu import cpu_info
from tokenmill.model.dtypes import (
    KV_CACHE_DTYPE_NAMES,
    resolve_device,
    resolve_kv_cache_dtype,
)
from tokenmill.model.host_memory import trim_freed_heap
from tokenmill.model.loader import load_model, resolve_dtype
from tokenmill.model.tensor_parallel import TPShard, shard_config
from tokenmill.model.thread_policy import default_thread_decision
from tokenmill.resolved_model import ResolvedModel
from tokenmill.sampling.sampler import Sampler
from tokenmill.worker.compiled_step import default_buckets
from tokenmill.worker.kv_cache import (
    allocate_kv_cache,
    kv_budget_bytes,
    kv_bytes_per_token,
    resident_bytes,
)
from tokenmill.worker.lora_manager import LoRAManager
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.request_state import RequestStates
from tokenmill.worker.spec_decode import Proposer, ProposerContext, build_proposer
from tokenmill.worker.step_runner import CompiledRunner, RunnerContext, choose_step_runners

logger = logging.getLogger(__name__)

RESIDENT_EVERY_S = 1.0
"""How often ``debug_stats`` measures the KV pool's resident bytes (``mincore`` over the
whole pool): the engine publishes stats after every step, and measuring a 4 GiB pool each
time cost tens of ms a token (a one-stream decode step is ~10 ms)."""


def _with_verify_bucket(config: EngineConfig, buckets: list[int]) -> list[int]:
    """static + speculation: one more compiled batch size when a step verifying drafts can
    have more rows (k + 1 per request) than the largest decode bucket (not with
    ``--compile-batch-sizes``: those are taken as given)."""
    spec = config.speculative
    if spec is None or config.compile_batch_sizes:
        return buckets
    rows = max_verify_rows(spec, config.max_num_seqs)
    return buckets + [rows] if rows > max(buckets, default=0) else buckets


class Worker:
    """One rank: owns its device, threads, dtype, model, KV tensors and runner."""

    def __init__(
        self, config: EngineConfig, resolved: ResolvedModel, rank: int = 0, world_size: int = 1
    ) -> None:
        start = time.monotonic()
        self.config = config
        self.resolved = resolved
        """The model as the engine resolved it (config, tokenizer, EOS ids): never re-read."""
        self.rank = rank
        self.world_size = world_size
        self.model_path = resolved.model_path
        self.model_config = mc = resolved.model_config
        self.device = resolve_device(config.device)
        threads = default_thread_decision(config.num_threads)
        self.num_threads = config.num_threads or max(1, threads.num_threads // world_size)
        if self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)
            if rank == 0:
                logger.info(
                    "CPU: %s; %d compute threads%s (%s); %s",
                    cpu_info().describe(),
                    self.num_threads,
                    f" per rank x {world_size} ranks" if world_size > 1 else "",
                    "; ".join(threads.reasons),
                    thread_policy.WAIT_POLICY_NOTE or "OpenMP wait policy: the runtime's own",
                )
        self.dtype = resolve_dtype(config.dtype, mc, self.device, config.quantization)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.kv_config = self._kv_config(mc)
        """The sizes of this rank's KV cache (its share of the KV heads under TP)."""
        self.model: CausalLM = self._load_model(mc)
        self.model_load_s = time.monotonic() - start
        self.states = RequestStates(self._compile_grammar)  # used where no grammar crossed
        self._grammar_compiler: Any = None
        self._lora_ids_in_use: set[int] = set()
        self._runner: ModelRunner | None = None
        self._resident = 0
        self._resident_at = -float("inf")
        self.resident_every_s = RESIDENT_EVERY_S
        """Seconds between two measurements of the pool's resident bytes (0: every call)."""
        self.proposer: Proposer | None = None
        """Speculative decoding's proposer (``spec_decode``); None without speculation."""

    @property
    def shard(self) -> TPShard | None:
        """This rank's place in the tensor-parallel group; None without one."""
        return TPShard(self.rank, self.world_size) if self.world_size > 1 else None

    def _kv_config(self, mc: ModelConfig) -> ModelConfig:
        shard = self.shard
        return mc if shard is None else shard_config(mc, shard)

    def _load_model(self, mc: ModelConfig) -> CausalLM:
        cfg = self.config
        backend = None
        if cfg.attention_backend is not None:  # else the loader's default: auto
            try:
                backend = select_attention_backend(cfg.attention_backend, self.device)
            except ValueError as exc:
                raise ConfigError(f"--attention-backend: {exc}") from None
        return load_model(
            self.model_path,
            self.dtype,
            self.device,
            self.max_model_len,
            mc,
            quantization=cfg.quantization,
            group_size=cfg.quantization_group_size,
            tensor_parallel=self.shard,
            attn_backend=backend,
            gguf_blocks=cfg.dtype == "auto",
        )

    # ---- start-up ------------------------------------------------------------------
    def describe(self) -> WorkerInfo:
        return WorkerInfo(
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=KV_CACHE_DTYPE_NAMES[self.kv_dtype],
            num_threads=self.num_threads,
            max_model_len=self.max_model_len,
            model_load_s=self.model_load_s,
        )

    def kv_cache_info(self) -> tuple[int, int]:
        """(KV bytes one token takes on this rank, the KV memory this rank may use)."""
        cfg = self.config
        return (
            kv_bytes_per_token(self.kv_config, self.kv_dtype),
            kv_budget_bytes(cfg.kv_cache_memory, cfg.gpu_memory_utilization, self.device),
        )

    def initialize_cache(self, spec: KVCacheSpec) -> CacheInfo:
        """Allocate the KV tensors, compile the decode step where it is right to, load the
        draft model and LoRA slots, build the runner."""
        start = time.monotonic()
        cfg = self.config
        caches = allocate_kv_cache(
            self.kv_config, spec.num_blocks, spec.block_size, self.kv_dtype, self.device
        )
        info = CacheInfo(
            kv_allocation_s=time.monotonic() - start,
            kv_cache_bytes=spec.num_blocks
            * spec.block_size
            * kv_bytes_per_token(self.kv_config, self.kv_dtype),
        )
        ctx = RunnerContext(
            config=cfg,
            model=self.model,
            kv_caches=caches,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            max_model_len=self.max_model_len,
            device=self.device,
            dtype=self.dtype,
            compile_buckets=_with_verify_bucket(
                cfg, list(cfg.compile_batch_sizes or default_buckets(cfg.max_num_seqs, self.device))
            ),
            compile_refusal=self._compile_refusal(spec, info),
        )
        choice = choose_step_runners(ctx)
        if self.rank == 0:
            logger.info(
                "step runner: %s; attention backend %s",
                choice.describe(),
                self.model.attn_backend.describe(),
            )
        for runner in choice.runners:
            if isinstance(runner, CompiledRunner):
                info.compile_time_s = runner.step.compile_time_s
                info.compile_s_by_bucket = dict(runner.step.compile_s_by_bucket)
                info.compile_cache_by_bucket = dict(runner.step.cache_by_bucket)
        lora = None
        if cfg.enable_lora:
            lora = LoRAManager(
                self.model_config,
                cfg.max_loras,
                cfg.max_cpu_loras or cfg.max_loras,
                cfg.max_lora_rank,
                self.dtype,
                self.device,
                ids_in_use=lambda: self._lora_ids_in_use | self.states.lora_ids(),
            )
            logger.info(
                "LoRA: %d slot(s) of rank %d (%.1f MiB)",
                cfg.max_loras,
                cfg.max_lora_rank,
                lora.stacks.nbytes / 2**20,
            )
        self._runner = ModelRunner(
            self.model,
            caches,
            spec.block_size,
            Sampler(self.device, cfg.seed),
            self.device,
            choice.runners,
            lora,
        )
        spec_config = cfg.speculative
        if spec_config is not None:
            self.proposer = build_proposer(
                ProposerContext(
                    config=cfg,
                    speculative=spec_config,
                    model=self.model,
                    model_config=self.model_config,
                    num_blocks=spec.num_blocks,
                    block_size=spec.block_size,
                    wants_compiled_decode=spec.wants_compiled_decode,
                    may_compile=not cfg.enforce_eager
                    and self._can_compile()
                    and self.world_size == 1,
                    dtype=self.dtype,
                    device=self.device,
                    max_model_len=self.max_model_len,
                )
            )
            info.compile_time_s += self.proposer.compile_time_s
        trim_freed_heap()  # what compiling and warming up freed
        return info

    def _compile_refusal(self, spec: KVCacheSpec, info: CacheInfo) -> str | None:
        """Why this rank's decode step is not compiled; None when it is."""
        cfg = self.config
        if not spec.wants_compiled_decode:
            return "the paged KV strategy without --compile-batch-sizes"
        if cfg.is_pooling:
            return "a pooling model never decodes"
        if cfg.enforce_eager:
            return "--enforce-eager"
        if not self._can_compile():
            return "this kernel table compiles these dtypes wrongly"
        if not self._model_compiles(info):
            return self.model.eager_reason
        if self.world_size != 1:
            return "tensor parallelism (the collectives run eagerly)"
        return None

    def _model_compiles(self, info: CacheInfo) -> bool:
        """False for models whose forward cannot be compiled with fixed shapes (MoE routing,
        the Transformers fallback); the reason goes back in ``info``."""
        if not self.model.supports_compiled_decode:
            info.eager_reason = self.model.eager_reason
        return self.model.supports_compiled_decode

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

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("the worker's cache is not initialized yet")
        return self._runner

    # ---- steps ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, plan: StepPlan) -> StepOutput | None:
        """Apply the diff and run the step (the draft proposes first); rank 0 answers.

        Per-request failures come back as text; only a failure of the whole step raises."""
        sched = self.states.apply(plan)
        proposer = self.proposer
        if proposer is not None:  # fills the draft slots the scheduler granted
            proposer.drop(plan.finished_ids)
            proposer.propose(sched)
        out = self.runner.execute(sched)
        if proposer is not None:  # counts only cross: the tokens stay here
            out.num_proposable = proposer.num_proposable(sched, out, plan.max_proposal)
        for rid in plan.draft_catch_up:
            out.num_draft_computed[rid] = self.states.requests[rid].num_draft_computed_tokens
        return out if self.rank == 0 else None

    def debug_stats(self) -> dict[str, Any]:
        """The model's own counters (MoE tokens per expert) and the KV pool's resident bytes."""
        stats: dict[str, Any] = dict(self.model.debug_stats())
        if self._runner is not None:
            now = time.monotonic()
            if now - self._resident_at >= self.resident_every_s:
                caches = [t for pair in self._runner.kv_caches for t in pair]
                self._resident = resident_bytes(caches)
                self._resident_at = now
            stats["kv_cache_resident_bytes"] = self._resident
        return stats

    def _compile_grammar(self, params: SamplingParams) -> object:
        """A grammar that did not cross the process boundary, compiled here (cached)."""
        from tokenmill.structured.grammar import GrammarCompiler

        if self._grammar_compiler is None:
            resolved = self.resolved
            self._grammar_compiler = GrammarCompiler(
                resolved.tokenizer.backend.to_str(),
                resolved.model_config.vocab_size,
                resolved.eos_token_ids,
            )
        assert params.structured_outputs is not None
        return self._grammar_compiler.compile(params.structured_outputs)

    # ---- LoRA adapters ---------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, ids_in_use: set[int]) -> None:
        """Load an adapter; ``ids_in_use`` (the engine's unfinished requests' adapters) are
        kept in the CPU cache whatever the LRU says."""
        manager = self.runner.lora
        if manager is None:
            raise RuntimeError("LoRA is not enabled on this worker")
        self._lora_ids_in_use = set(ids_in_use)
        manager.add(lora_request)

    def has_lora(self, lora_id: int) -> bool:
        manager = self.runner.lora
        return manager is not None and manager.get(lora_id) is not None

    def remove_lora(self, lora_id: int) -> bool:
        manager = self.runner.lora
        return manager is not None and bool(manager.remove(lora_id))

    def list_loras(self) -> list[int]:
        manager = self.runner.lora
        return manager.ids() if manager is not None else []

    def shutdown(self) -> None:
        """Nothing to release in-process; a worker process exits after this."""
