"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), grouped by expert.

Routing follows each checkpoint's own rules: softmax over all experts in fp32, top-k,
then renormalise the k weights (Mixtral always; Qwen when ``norm_topk_prob``); Qwen casts
the weights to the model dtype before mixing, Mixtral mixes in fp32. Qwen2-MoE adds an
always-on shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

Dispatch is by expert for the whole batch, never per token: the (token, expert) pairs
are sorted by expert, each active expert runs one gate/up and one down matmul over its
contiguous rows, and the weighted outputs are scattered back with ``index_add_``. Experts
are ordinary ``Linear`` modules, so int8/int4 weight-only quantization and oneDNN
prepacking apply to them as to any projection. The one host sync per layer (the count
of rows per expert) makes the forward unsuited to torch.compile's fixed graphs, so MoE
models run the static strategy's decode step eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.config import ModelConfig
from tokenmill.model.layers import ACT_AND_MUL, Linear
from tokenmill.model.lora import LoRAStepState


class Expert(nn.Module):
    """One gated MLP expert: fused [gate|up], then down."""

    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * inter)
        self.down = Linear(inter, hidden)
        self.act_and_mul = ACT_AND_MUL[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act_and_mul(self.gate_up(x)))


class SparseMoE(nn.Module):
    """Top-k routed experts (plus Qwen2-MoE's shared expert), dispatched by expert."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.mix_in_fp32 = cfg.moe == "mixtral"
        self.router = Linear(h, cfg.num_experts)
        self.experts = nn.ModuleList(
            Expert(h, cfg.moe_intermediate_size, cfg.hidden_act) for _ in range(cfg.num_experts)
        )
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = Expert(h, shared, cfg.hidden_act) if shared else None
        self.shared_expert_gate = Linear(h, 1) if shared else None
        self.tokens_per_expert = torch.zeros(cfg.num_experts, dtype=torch.long)
        """Tokens routed to each expert since start-up (a plain tensor, not model state)."""

    def reset_state(self, device: torch.device) -> None:
        """Zero the router counters, on ``device`` (the loader builds on the meta device)."""
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for each token."""
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.mix_in_fp32:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, lora: LoRAStepState | None = None) -> torch.Tensor:
        """``lora`` is accepted for the call site's sake: adapters target attention only."""
        weights, experts = self.route(x)
        out = self.dispatch(x, weights, experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out

    def dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(token), grouped by expert."""
        flat_experts = experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        self.tokens_per_expert += counts
        token_rows = order // self.top_k
        sorted_x = x.index_select(0, token_rows)
        sorted_w = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert_id, num_rows in enumerate(counts.tolist()):
            if num_rows == 0:
                continue
            end = start + num_rows
            y = self.experts[expert_id](sorted_x[start:end]) * sorted_w[start:end]
            out.index_add_(0, token_rows[start:end], y.to(x.dtype))
            start = end
        return out
