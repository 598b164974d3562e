"""LLM: the offline API (vLLM's ``LLM``): generate or chat over many prompts at once."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.core.beam_search_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.engine import batch
from tokenmill.engine.input_processor import CheckedParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.prompt_inputs import Prompt, PromptInput, parse_prompts
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams

Prompts = PromptInput | Sequence[PromptInput]
"""vLLM's prompt forms (see ``prompt_inputs``): one prompt or a sequence of them."""


class LLM:
    """Run batches of prompts to completion with continuous batching."""

    def __init__(
        self, model: str = "demo", config: EngineConfig | None = None, **engine_kwargs: Any
    ) -> None:
        """Build an engine from keyword options (EngineConfig field names) or a ready config."""
        self.engine = LLMEngine(config or EngineConfig.from_kwargs(model=model, **engine_kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The engine's tokenizer, under vLLM's ``LLM.get_tokenizer()`` name."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (any of vLLM's forms); outputs come back in input order.

        ``lora_request`` runs every prompt with one adapter, or each with its own (None: the
        base model); the engine needs ``enable_lora=True``. A prompt dict's ``cache_salt``
        keeps its prefix-cache blocks to prompts with the same salt, as in vLLM.
        """
        parsed = parse_prompts(prompts, "LLM.generate")
        prompt_list = [p.prompt for p in parsed]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise ValueError(
                    f"got {len(prompt_list)} prompts but {len(params)} sampling params"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"got {len(prompt_list)} prompts but {len(loras)} LoRA requests")
        ids = [str(next(self._ids)) for _ in prompt_list]
        bar = self._bar(len(ids), use_tqdm)
        try:
            return batch.generate(
                self.engine,
                ids,
                prompt_list,
                params,
                priority,
                loras,
                bar.update,
                cache_salts=[p.cache_salt for p in parsed],
            )
        finally:
            bar.close()

    def beam_search(
        self,
        prompts: Prompts,
        params: BeamSearchParams,
        use_tqdm: bool | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over every prompt (vLLM's ``LLM.beam_search``): ``beam_width`` sequences
        per prompt, best first. Beams share their prompt's KV blocks, copy-on-write."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        return [
            BeamSearchOutput(
                [
                    BeamSearchSequence(
                        tokens=out.prompt_token_ids + c.token_ids,
                        output_token_ids=c.token_ids,
                        text=c.text,
                        cum_logprob=c.cumulative_logprob or 0.0,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in out.outputs
                ]
            )
            for out in outputs
        ]

    def embed(
        self,
        prompts: Prompts,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | None = None,
    ) -> list[list[float]]:
        """One embedding per prompt (vLLM's ``LLM.embed``; needs ``runner="pooling"``), pooled as
        the checkpoint declares unless ``pooling_params`` says otherwise."""
        return [out.pooled or [] for out in self._pool(prompts, pooling_params, use_tqdm, "embed")]

    def encode(
        self,
        prompts: Prompts,
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """The finished pooling request of each prompt (vLLM's ``LLM.encode``; needs
        ``runner="pooling"``): its ``pooled`` vector with the prompt's token ids."""
        return self._pool(prompts, pooling_params, use_tqdm, "encode")

    def _pool(
        self,
        prompts: Prompts,
        pooling_params: PoolingParams | None,
        use_tqdm: bool | None,
        api: str,
    ) -> list[RequestOutput]:
        config = self.engine.pooler_config
        if config is None:
            raise ValueError(f'LLM.{api} needs an engine built with runner="pooling"')
        parsed = parse_prompts(prompts, f"LLM.{api}")
        processor = self.engine.input_processor
        params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        checked = CheckedParams(params, 0, pooling=pooling_params or config.params())
        ids = [str(next(self._ids)) for _ in parsed]
        # Every input is checked before any is queued: a bad one leaves nothing running.
        processed = [
            processor.process_prompt(rid, p.prompt, replace(checked, cache_salt=p.cache_salt))
            for rid, p in zip(ids, parsed, strict=True)
        ]
        for request in processed:
            self.engine.add_processed(request)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Render conversations with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template
                ),
                add_special_tokens=False,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _bar(self, total: int, use_tqdm: bool | None) -> tqdm:
        """A progress bar, shown by default from 8 prompts up."""
        show = use_tqdm if use_tqdm is not None else total >= 8
        return tqdm(total=total, desc="Processed prompts", unit="req", disable=not show)

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        bar = self._bar(len(ids), use_tqdm)
        try:
            return batch.run_to_completion(self.engine, ids, bar.update)
        finally:
            bar.close()
