"""The engines ``bench offline`` can drive in-process, behind one small interface.

Each backend loads a model once, then ``run`` completes a list of requests that all
arrive at the start and returns one ``RequestRecord`` per request plus the wall time.
``tokenmill`` runs the ``LLM`` API's loop (``engine.batch``), one engine per KV strategy, with its prefix cache
emptied before every run so no run reuses an earlier one's prompts; ``transformers`` runs ``generate`` on left-padded
static batches (a batch starts only when the previous one is done, as users of plain
``generate`` do); ``transformers-cb`` uses transformers' own continuous batching
manager when the installed version has one, and otherwise reports why it is skipped.
Loading a ``transformers`` model (also ``verify``'s reference) lives here too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.tokenization import encode_text, load_tokenizer
from tokenmill.config import default_step_tokens
from tokenmill.model.loader import TORCH_DTYPES

if TYPE_CHECKING:
    from tokenmill.bench.offline import OfflineConfig

BACKEND_NAMES: tuple[str, ...] = ("tokenmill", "transformers", "transformers-cb")
"""Values accepted by ``--backends``."""


class OfflineBackend(Protocol):
    """What ``bench offline`` needs from an engine."""

    label: str
    """Row name in reports, e.g. ``tokenmill[paged]``."""

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run here (then it is skipped), or None."""

    def load_figures(self) -> dict[str, Any]:
        """Backend-specific start-up figures for its row, e.g. ``compile_time_s``."""

    def run_figures(self) -> dict[str, Any]:
        """Backend-specific figures of the latest run, e.g. KV reserved vs used."""

    def prepare(self, requests: list[BenchRequest]) -> None:
        """Size anything workload-dependent once, before warm-up."""

    def run(self, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
        """Complete every request (all arriving now); records in input order, wall seconds."""

    def close(self) -> None:
        """Release threads and memory held by the backend."""


def _prompt_ids(request: BenchRequest, tokenizer: Any) -> list[int]:
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    return encode_text(tokenizer, request.prompt_text or "")


def load_transformers_model(model: str, dtype: str, device: torch.device | str) -> Any:
    """``AutoModelForCausalLM`` of a local model folder (or ``demo``) in ``dtype``, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    from tokenmill.model.source import resolve_model_path

    if dtype not in TORCH_DTYPES:
        raise ValueError(
            f"transformers needs an explicit dtype ({', '.join(TORCH_DTYPES)}), got {dtype!r}"
        )
    hf_model = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_path(model)), dtype=TORCH_DTYPES[dtype]
    )
    # transformers types ``to`` through a decorator whose signature drops ``self``
    return hf_model.to(device).eval()  # type: ignore[arg-type]


class TokenmillBackend:
    """tokenmill's engine through the offline ``LLM`` API's loop (``engine.batch``), with one
    KV strategy."""

    def __init__(self, config: OfflineConfig, kv_cache: str) -> None:
        from tokenmill.config import EngineConfig
        from tokenmill.engine.llm_engine import LLMEngine

        self.label = f"tokenmill[{kv_cache}]"
        self.ignore_eos = config.ignore_eos
        self._run_kv = (0, 0, 0)
        """Steps, reserved token-steps and used token-steps of the latest run."""
        self.engine = LLMEngine(
            EngineConfig.from_kwargs(
                model=config.model,
                dtype=config.engine_dtype or config.dtype,
                kv_cache=kv_cache,
                device=config.device,
                **config.engine_kwargs,
            )
        )
        self._ids = itertools.count()

    def unavailable_reason(self) -> str | None:
        return None

    def load_figures(self) -> dict[str, Any]:
        stats = self.engine.stats
        startup = self.engine.startup
        return {
            "compile_time_s": stats.compile_time_s,
            "precision": dict(stats.precision),
            "compile_cache": startup.compile_cache,
            "startup": startup.as_dict(),
        }

    def run_figures(self) -> dict[str, Any]:
        """KV token slots reserved vs holding tokens, averaged over the latest run's steps."""
        steps, reserved, used = self._run_kv
        if not steps:
            return {}
        return {
            "kv_pool_tokens": self.engine.stats.kv_capacity_tokens,
            "kv_reserved_tokens_mean": reserved / steps,
            "kv_used_tokens_mean": used / steps,
            "kv_waste": 1.0 - used / reserved if reserved else None,
        }

    def prepare(self, requests: list[BenchRequest]) -> None:
        return None

    def run(self, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
        from tokenmill.core.sampling_params import SamplingParams
        from tokenmill.engine import batch

        # Each run starts cold: KV left by warm-ups or earlier rounds would let tokenmill skip
        # prefill that the other backends recompute.
        self.engine.kv_manager.reset_prefix_cache()
        prompts = [_prompt_ids(r, self.engine.tokenizer) for r in requests]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=self.ignore_eos)
            for r in requests
        ]
        before = self.engine.stats
        start_mono_s = time.monotonic()
        start_s = time.perf_counter()
        ids = [str(next(self._ids)) for _ in requests]
        outputs = batch.generate(self.engine, ids, prompts, params)
        duration_s = time.perf_counter() - start_s
        after = self.engine.stats
        self._run_kv = (
            after.num_steps - before.num_steps,
            after.kv_reserved_token_steps - before.kv_reserved_token_steps,
            after.kv_used_token_steps - before.kv_used_token_steps,
        )
        records = []
        for index, out in enumerate(outputs):
            m = out.metrics
            completion = out.outputs[0]
            record = RequestRecord(
                index=index,
                send_time_s=m.arrival_time - start_mono_s,
                prompt_tokens=len(out.prompt_token_ids),
                output_tokens_source="engine",
            )
            if m.first_token_time is None or completion.finish_reason == "abort":
                record.error = (
                    f"engine finished the request without tokens ({completion.finish_reason})"
                )
            else:
                end_time = m.finished_time or m.last_token_time or m.first_token_time
                record.success = True
                record.ttft_s = m.first_token_time - m.arrival_time
                record.e2e_s = end_time - m.arrival_time
                record.output_tokens = len(completion.token_ids)
            records.append(record)
        return records, duration_s

    def close(self) -> None:
        del self.engine


class _StepTimer:
    """A stopping criterion that never stops: it only stamps when each token step ends."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.times_s.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _TransformersBase:
    """Loads the model folder with ``AutoModelForCausalLM`` in the configured dtype."""

    def __init__(self, config: OfflineConfig) -> None:
        self.device = torch.device(config.resolved_device)
        self.ignore_eos = config.ignore_eos
        self.model = load_transformers_model(config.model, config.dtype, self.device)
        self.tokenizer = load_tokenizer(config.model)
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

    def unavailable_reason(self) -> str | None:
        return None

    def load_figures(self) -> dict[str, Any]:
        return {}

    def run_figures(self) -> dict[str, Any]:
        return {}

    def prepare(self, requests: list[BenchRequest]) -> None:
        return None

    def _output_len(self, tokens: list[int], output_len: int) -> int:
        """Tokens that count: up to the request's own length, and through EOS unless ignored."""
        tokens = tokens[:output_len]
        if not self.ignore_eos:
            for i, t in enumerate(tokens):
                if t in self.eos_ids:
                    return i + 1
        return len(tokens)

    def close(self) -> None:
        del self.model


class TransformersBackend(_TransformersBase):
    """``model.generate`` on left-padded static batches of ``batch_size`` requests."""

    def __init__(self, config: OfflineConfig) -> None:
        super().__init__(config)
        self.label = f"transformers[bs={config.batch_size}]"
        self.batch_size = config.batch_size

    def run(self, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
        from transformers import StoppingCriteriaList

        start_s = time.perf_counter()
        records: list[RequestRecord] = []
        for first in range(0, len(requests), self.batch_size):
            batch = requests[first : first + self.batch_size]
            prompts = [_prompt_ids(r, self.tokenizer) for r in batch]
            width = max(len(p) for p in prompts)
            input_ids = torch.tensor(
                [[self.pad_id] * (width - len(p)) + p for p in prompts], device=self.device
            )
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
            )
            max_new = max(r.output_len for r in batch)
            timer = _StepTimer()
            kwargs: dict[str, Any] = {
                "max_new_tokens": max_new,
                "do_sample": False,
                "pad_token_id": self.pad_id,
                "stopping_criteria": StoppingCriteriaList([timer]),
            }
            if self.ignore_eos:
                kwargs["min_new_tokens"] = max_new
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
            generated = out[:, width:].tolist()
            for j, request in enumerate(batch):
                num_tokens = self._output_len(generated[j], request.output_len)
                record = RequestRecord(
                    index=first + j,
                    send_time_s=0.0,
                    prompt_tokens=len(prompts[j]),
                    output_tokens_source="engine",
                )
                if num_tokens == 0 or not timer.times_s:
                    record.error = "generate returned no tokens"
                else:
                    record.success = True
                    record.output_tokens = num_tokens
                    record.ttft_s = timer.times_s[0] - start_s
                    record.e2e_s = timer.times_s[min(num_tokens, len(timer.times_s)) - 1] - start_s
                records.append(record)
        return records, time.perf_counter() - start_s


class TransformersCBBackend(_TransformersBase):
    """transformers' continuous batching manager, kept running across runs."""

    def __init__(self, config: OfflineConfig) -> None:
        super().__init__(config)
        import transformers

        self.label = "transformers-cb"
        self.version = transformers.__version__
        self.manager: Any = None

    def unavailable_reason(self) -> str | None:
        if not hasattr(self.model, "init_continuous_batching"):
            return f"transformers {self.version} has no continuous batching (needs a version with generate_batch)"
        return None

    def prepare(self, requests: list[BenchRequest]) -> None:
        """Start a manager whose KV cache fits this workload.

        Left to itself the manager sizes its cache from free memory, which on CPU means
        most of the machine's RAM and tens of seconds of allocation; the workload's own
        token count (plus a page per request of slack) is what a fair comparison needs.
        """
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = {}
        with contextlib.suppress(ImportError):
            from transformers import ContinuousBatchingConfig

            page_size = 256
            num_tokens = sum(r.prompt_len + r.output_len for r in requests)
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
                page_size=page_size,
                num_blocks=math.ceil(num_tokens / page_size) + len(requests),
                # tokenmill's default step budget on this device, for a like-for-like step
                max_batch_tokens=default_step_tokens(self.device.type),
            )
        generation_config = GenerationConfig(
            max_new_tokens=max(r.output_len for r in requests),
            do_sample=False,
            eos_token_id=sorted(self.eos_ids) or None,
            pad_token_id=self.pad_id,
        )
        self.manager = self.model.init_continuous_batching(
            generation_config=generation_config, **kwargs
        )
        self.manager.start()

    def run(self, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
        if self.manager is None:
            self.prepare(requests)
        prompts = [_prompt_ids(r, self.tokenizer) for r in requests]
        start_s = time.perf_counter()
        ids = {}
        for index, (prompt, request) in enumerate(zip(prompts, requests, strict=True)):
            request_id = f"bench-{start_s:.6f}-{index}"
            self.manager.add_request(
                prompt,
                request_id=request_id,
                max_new_tokens=request.output_len,
                record_timestamps=True,
                eos_token_id=-1 if self.ignore_eos else None,
            )
            ids[request_id] = index
        results: dict[str, Any] = {}
        while len(results) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    break
                continue
            if result.request_id in ids and result.is_finished():
                results[result.request_id] = result
        duration_s = time.perf_counter() - start_s
        records = []
        for request_id, index in ids.items():
            record = RequestRecord(
                index=index, prompt_tokens=len(prompts[index]), output_tokens_source="engine"
            )
            result = results.get(request_id)
            stamps = (result.timestamps or []) if result is not None else []
            if result is None or result.error or not stamps:
                record.error = f"transformers-cb: {getattr(result, 'error', None) or 'no result'}"
            else:
                record.success = True
                record.output_tokens = self._output_len(
                    list(result.generated_tokens), requests[index].output_len
                )
                record.ttft_s = stamps[0] - start_s
                record.e2e_s = stamps[min(record.output_tokens, len(stamps)) - 1] - start_s
                record.itl_s = [
                    b - a for a, b in itertools.pairwise(stamps[: record.output_tokens])
                ]
            records.append(record)
        return records, duration_s

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=5)
            self.manager.destroy()
            self.manager = None
        super().close()


def make_backend(name: str, config: OfflineConfig, kv_cache: str | None = None) -> OfflineBackend:
    """Load the named backend (slow: it loads the model); ``kv_cache`` picks tokenmill's strategy."""
    if name == "tokenmill":
        return TokenmillBackend(config, kv_cache or config.kv_caches[0])
    if name == "transformers":
        return TransformersBackend(config)
    if name == "transformers-cb":
        return TransformersCBBackend(config)
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
