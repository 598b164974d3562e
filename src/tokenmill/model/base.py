"""CausalLM: what the loader, the model runner and the compiled decode step rely on in a model.

The runner and the compiled step name only this class, never a family's implementation,
so another implementation (a different decoder, a Transformers-backed fallback) plugs in
by subclassing it and registering in ``model/registry.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.attention_backend import AttentionBackend, StepMetadata
from tokenmill.model.config import ModelConfig
from tokenmill.model.lora import LoRAStepState


class CausalLM(nn.Module):
    """A decoder-only LM over the block-table KV cache, attending through ``attn_backend``."""

    config: ModelConfig
    attn_backend: AttentionBackend
    supports_compiled_decode: bool = True
    """Whether the forward can be compiled with fixed shapes (``worker/compiled_step.py``)."""
    eager_reason: str = "its forward has data-dependent shapes: expert routing"
    """Why the forward runs eagerly when ``supports_compiled_decode`` is False (logged)."""

    runs_fused_decode: bool = False
    """Whether decode-only steps run the decoder layers in one kernel call; the step runner
    chosen at start-up sets it (``worker/step_runner.py``), after ``fused_decode_refusal``."""

    def fused_decode_refusal(self, dtype: torch.dtype) -> str | None:
        """Why this model's decode steps cannot run as one kernel call with ``dtype``
        activations (logged at start-up); None when they can."""
        return f"{type(self).__name__} has no fused decode step"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: StepMetadata,
        lora: LoRAStepState | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for a flat batch of tokens."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the rows that need them."""
        raise NotImplementedError

    def debug_stats(self) -> dict[str, list[list[int]]]:
        """Counters for debugging and /metrics (MoE: tokens routed per layer and expert)."""
        return {}
