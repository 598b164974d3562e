"""EngineConfig: every engine limit and strategy in one frozen, validated dataclass.

CLI flags are generated from these fields (``entrypoints/config_args.py``): the name, type,
default and the docstring under each field are the flag's, so each is written once here.
The engine resolves ``auto`` and ``None`` values once it has loaded the model and keeps the
resolved config (``LLMEngine.config``): consumers read ``max_model_len``, ``device`` and
``dtype`` from it instead of working them out again.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from tokenmill.core.speculative import SpeculativeConfig
from tokenmill.errors import ConfigError
from tokenmill.sizes import parse_size

KVCacheKind = Literal["paged", "static"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["int8", "int4"]
KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4")
KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto",
    "float32",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
)
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
SchedulingPolicy = Literal["fcfs", "priority"]
LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors")
PICKLE_LOAD_FORMATS: tuple[str, ...] = ("pt", "npcache")
"""vLLM's load formats that unpickle: refused, since loading them can run code."""
Runner = Literal["auto", "generate", "pooling"]
Convert = Literal["auto", "none", "embed"]
ModelImpl = Literal["auto", "native", "transformers"]
MODEL_IMPLS: tuple[str, ...] = ("auto", "native", "transformers")


def default_step_tokens(device_type: str) -> int:
    """A step's token budget where --max-num-batched-tokens is not given: 1024 on a CPU (the
    field's docs say why), 2048 elsewhere (vLLM's default for its API server)."""
    return 1024 if device_type == "cpu" else 2048


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine instance."""

    model: str = "demo"
    """Path of a Hugging Face model folder, or ``demo`` for the built-in model."""
    model_impl: ModelImpl = "auto"
    """auto: tokenmill's own implementation for native families, Transformers' modeling code over tokenmill's KV cache for any other causal LM; native or transformers forces one."""
    dtype: DType = field(default="auto", metadata={"parse": "dtype"})
    """Weights and activations dtype; auto: on CPU, bfloat16 where the CPU runs it natively (AVX512-BF16/AMX), float32 checkpoints included (as vLLM), else float32; on a GPU the checkpoint's."""
    quantization: Quantization | None = field(default=None, metadata={"aliases": ("-q",)})
    """Weight-only quantization applied at load: int8 (per output channel) or int4 (group-wise)."""
    quantization_group_size: int = 32
    """int4 only: input channels sharing one scale and zero point (32, 64, 128 or 256); 32, as llama.cpp's Q4 blocks, keeps real models' answers (docs/benchmarks.md: SmolLM2-135M passes verify at 32, fails at 128)."""
    kv_cache_dtype: KVCacheDType = "auto"
    """KV cache storage: auto (the model dtype), float32, bfloat16, float16, fp8 (= fp8_e4m3) or fp8_e5m2 (fp8 with per-layer scales)."""
    device: str = "auto"
    """``cpu``, ``cuda`` or ``auto`` (cuda when available)."""
    kv_cache: KVCacheKind = "paged"
    """KV memory strategy: ``paged`` blocks on demand or ``static`` per-slot regions."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: float | None = field(
        default=None, metadata={"parse": "memory", "aliases": ("--kv-cache-memory-bytes",)}
    )
    """KV budget: a fraction of free memory (0.3) or a size (4GiB); default: a sane share."""
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"aliases": ("--device-memory-utilization",)}
    )
    """On CUDA, the fraction of total GPU memory the engine may use (weights + KV)."""
    max_num_seqs: int = 256
    """Maximum number of requests in the running batch."""
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step (prefill chunks plus decodes); default: 1024 on a CPU, 2048 on a GPU (vLLM's). A CPU computes a prompt's tokens at a few thousand a second, so a 2048-token step holds every running stream for 0.6-1 s even on a 135M model; 1024 halves that stall and lets half a burst start sooner, at the same throughput (docs/benchmarks.md)."""
    max_model_len: int | None = field(default=None, metadata={"parse": "max_model_len"})
    """Context length limit (4096, 32k, 32K); default (or auto): the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    prefix_cache_fills_pool: bool = False
    """Take never-used KV blocks before evicting cached prefixes, so the prefix cache can grow to the whole --kv-cache-memory (more hits for multi-turn traffic, but resident memory then climbs to the pool's size over hours). Off: a freed block is reused before a never-used one is touched, so resident memory follows the live working set."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps of --max-num-batched-tokens; off: a prompt is prefilled in one step (the step budget grows to --max-model-len)."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """``fcfs`` or ``priority`` (lower value first, then arrival)."""
    max_beam_search_requests: int = 4
    """Beam search requests running at once; more wait in their own queue, not ahead of other requests."""
    max_logprobs: int = 20
    """Largest ``logprobs`` / ``prompt_logprobs`` a request may ask for."""
    seed: int = 0
    """Seed of the engine's global generator (for requests without their own seed)."""
    enforce_eager: bool = False
    """Disable torch.compile and CUDA graph capture (static strategy)."""
    compile_batch_sizes: tuple[int, ...] | None = None
    """Decode batch sizes to compile, e.g. 1,2,4,8. static: default powers of two up to max_num_seqs; paged compiles its decode-only steps only when given (one compile per size at start-up; inductor's cache makes later starts warm)."""
    attention_backend: str | None = None
    """Attention backend (``model/attention_backend.py``'s ``BACKENDS``: torch_sdpa, which runs tokenmill's CPU kernels where they apply); default: the first that serves the device."""
    fused_decode: bool = True
    """Run a decode-only step's decoder layers in one CPU-kernel call where every layer allows it (the fused step runner; the start-up log names the layer feature that keeps it out). Off: layer by layer. TOKENMILL_FUSED_DECODE=0 overrides."""
    num_threads: int | None = None
    """CPU compute threads; default: one per physical core of the CPUs this process may use, at most its cgroup CPU quota (logged at start-up with the reason)."""
    enable_lora: bool = False
    """Serve LoRA adapters on top of the model (reserves --max-loras device slots at start-up)."""
    max_loras: int = 1
    """LoRA adapters one batch may use at once (device slots)."""
    max_lora_rank: int = 16
    """Largest LoRA rank accepted; slots are sized for it."""
    max_cpu_loras: int | None = None
    """LoRA adapters kept loaded in CPU memory, least recently used evicted; default: --max-loras."""
    hf_config_path: str | None = None
    """A local config.json, or the folder holding one, to use as the model's config instead of the model folder's own (a GGUF file's: the one its metadata gives); it must describe the same weights. Hub ids are refused: nothing is downloaded."""
    tokenizer: str | None = None
    """Folder of the tokenizer to use instead of the model folder's."""
    trust_remote_code: bool = False
    """Accepted for vLLM command lines; remote code is never run: tokenmill implements each architecture itself."""
    load_format: str = "auto"
    """Weights format: auto or safetensors (the only one read); pickle formats (pt, npcache) are refused, as they can run code."""
    generation_config: str = "auto"
    """Default sampling parameters: auto (the model's generation_config.json), vllm (none) or a folder with a generation_config.json."""
    override_generation_config: dict[str, Any] | None = field(
        default=None, metadata={"parse": "json_object"}
    )
    """A JSON object over those defaults, e.g. '{"temperature": 0.5, "max_new_tokens": 256}'."""
    runner: Runner = "auto"
    """What the model serves, as vLLM's --runner: generate (text) or pooling (embeddings, /v1/embeddings and /pooling); auto: generate."""
    convert: Convert = "auto"
    """vLLM's --convert: embed serves a causal LM as an embedding model (implies --runner pooling); auto: embed under --runner pooling."""
    speculative_config: dict[str, Any] | None = field(
        default=None, metadata={"parse": "json_object", "aliases": ("-sc",)}
    )
    """Speculative decoding, vLLM's JSON: '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}' (prompt lookup), or '{"model": DRAFT_DIR, "num_speculative_tokens": 3}' (a draft model with the same tokenizer; demo-draft for the demo); "disable_by_batch_size" (default 8) turns it off above that many running requests."""
    tensor_parallel_size: int = field(default=1, metadata={"aliases": ("-tp",)})
    """Ranks the model is split across (one worker process each; torch.distributed: gloo on CPU, NCCL on CUDA)."""
    distributed_executor_backend: str | None = None
    """How workers run: uni (in the engine's process) or mp (one process per rank); default: uni at tensor-parallel size 1, else mp."""
    rope_theta_override: float | None = None
    """Test-only: replace the model's RoPE base to make the engine diverge on purpose."""

    def __post_init__(self) -> None:
        def check(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(message)

        check(
            self.kv_cache in ("paged", "static"),
            f"kv_cache must be paged or static, got {self.kv_cache!r}",
        )
        check(
            self.model_impl in MODEL_IMPLS,
            f"--model-impl {self.model_impl!r} is not supported; choose one of {', '.join(MODEL_IMPLS)}",
        )
        check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"--dtype {self.dtype!r} is not supported; choose one of auto, float32, bfloat16, float16",
        )
        check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            f"unsupported device {self.device!r}",
        )
        check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two <= 128, got {self.block_size}",
        )
        check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"--quantization {self.quantization!r} is not supported; choose one of {', '.join(QUANTIZATIONS)}",
        )
        check(
            self.quantization_group_size in INT4_GROUP_SIZES,
            f"--quantization-group-size {self.quantization_group_size} is not supported; choose one of {', '.join(map(str, INT4_GROUP_SIZES))}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}",
        )
        check(
            self.load_format not in PICKLE_LOAD_FORMATS,
            f"--load-format {self.load_format}: pickled checkpoints can run arbitrary code when loaded, "
            "so tokenmill loads only safetensors (convert the checkpoint with safetensors' convert script)",
        )
        check(
            self.load_format in LOAD_FORMATS,
            f"--load-format {self.load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}",
        )
        check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens must be >= 1",
        )
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        size: object = self.kv_cache_memory
        if isinstance(size, str):  # LLM(kv_cache_memory="4GiB"), as the flag takes it
            try:
                object.__setattr__(self, "kv_cache_memory", parse_size(size))
            except ValueError as exc:
                raise ConfigError(f"kv_cache_memory: {exc}") from None
        check(
            self.kv_cache_memory is None or isinstance(self.kv_cache_memory, numbers.Real),
            f"kv_cache_memory must be a fraction, a byte count or a size like '4GiB', got {self.kv_cache_memory!r}",
        )
        check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory must be > 0"
        )
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        check(
            self.scheduling_policy in ("fcfs", "priority"),
            f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}",
        )
        check(self.max_logprobs >= 0, "max_logprobs must be >= 0")
        check(self.max_beam_search_requests >= 1, "max_beam_search_requests must be >= 1")
        check(
            self.compile_batch_sizes is None
            or (bool(self.compile_batch_sizes) and all(b >= 1 for b in self.compile_batch_sizes)),
            "compile_batch_sizes must be positive integers",
        )
        check(
            self.runner in ("auto", "generate", "pooling"),
            f"--runner {self.runner!r} is not supported; choose one of auto, generate, pooling",
        )
        check(
            self.convert in ("auto", "none", "embed"),
            f"--convert {self.convert!r} is not supported; choose one of auto, none, embed",
        )
        check(
            not (self.convert == "embed" and self.runner == "generate"),
            "--convert embed makes an embedding model: it needs --runner pooling (or auto), not generate",
        )
        check(
            not (self.convert == "none" and self.runner == "pooling"),
            "--runner pooling serves a causal LM through --convert embed; --convert none leaves "
            "nothing to pool with",
        )
        if self.speculative_config is not None:
            self.speculative  # noqa: B018 - parses, raising ConfigError on a bad field
        check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        check(
            self.distributed_executor_backend in (None, "uni", "mp"),
            f"--distributed-executor-backend must be uni or mp, got {self.distributed_executor_backend!r}",
        )
        check(
            self.tensor_parallel_size == 1 or self.distributed_executor_backend != "uni",
            "--tensor-parallel-size > 1 needs --distributed-executor-backend mp (one process per rank)",
        )
        check(self.max_loras >= 1, "max_loras must be >= 1")
        check(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        check(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras must be >= max_loras",
        )

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed and checked, once (the typed object every reader
        gets); None: no speculation."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def step_token_budget(self, device_type: str) -> int:
        """``max_num_batched_tokens``, or where it is not given the default for the device
        the engine runs on (``cpu``, ``cuda``)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return default_step_tokens(device_type)

    @property
    def is_pooling(self) -> bool:
        """Whether the engine pools hidden states (embeddings) instead of generating."""
        return self.runner == "pooling" or self.convert == "embed"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build a config, rejecting unknown keys with the list of valid ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**kwargs)
