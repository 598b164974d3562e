"""LoRA adapters on the shared decoder: PEFT folders in, a batched low-rank delta out.

Owns reading a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and
checking it against the model, the packed per-slot weights (``LoRAStacks``) and the delta
one step adds at the projection call sites (``LoRAStepState.apply``). The decoder fuses
q/k/v and gate/up, so an adapter's slices are packed: the A of every slice side by side
``[in, slices * max_rank]`` (one shrink matmul for the fused input), and one B per slice
``[max_rank, slice out]`` with the scaling folded in, each expanding its own part of the
shrunk activations into its own columns of the fused output; zeros for slices the adapter
does not target, and for ranks below ``max_rank``. (A block-diagonal B for the fused
output would be one matmul, but would read mostly zeros: a step's LoRA cost is reading
the weights.)

A step groups its token rows by adapter slot: one gather, two batched matmuls over the
slots in use and one scatter-add per projection, whatever the number of requests; rows on
the base model are in no group and cost nothing, and a step without adapter rows has no
LoRA state at all.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.errors import InvalidRequestError
from tokenmill.model.config import ModelConfig
from tokenmill.model.registry import lora_layout

FUSED_MODULES = ("qkv", "o", "gate_up", "down")
"""The decoder's projections a LoRA delta can be added to."""

PEFT_TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv", 0),
    "k_proj": ("self_attn", "qkv", 1),
    "v_proj": ("self_attn", "qkv", 2),
    "o_proj": ("self_attn", "o", 0),
    "gate_proj": ("mlp", "gate_up", 0),
    "up_proj": ("mlp", "gate_up", 1),
    "down_proj": ("mlp", "down", 0),
}
"""PEFT module name -> (its block, the fused projection it belongs to, its slice there)."""

_TENSOR = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.weight")
_LAYER_MODULE = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>\w+)"
)
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable_token_indices",
}


class LoRAError(InvalidRequestError):
    """An adapter cannot be used with this model; the message names the file and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="lora_path")


def fused_layout(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per fused projection: input features and the output features of each slice
    (from the registry's layout; a mixture-of-experts model has attention ones only)."""
    return lora_layout(cfg)


@dataclass
class LoRAAdapter:
    """One adapter's weights, packed for its slot (on the CPU until a step needs them)."""

    name: str
    path: str
    rank: int
    """The largest rank of any of its modules."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]]
    """(layer, fused projection) -> (A [in, slices * max_rank], per slice B [max_rank, out] * scaling)."""

    @property
    def modules(self) -> frozenset[str]:
        """Fused projections it changes."""
        return frozenset(module for _, module in self.weights)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + sum(b.nbytes for b in bs) for a, bs in self.weights.values())


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key matching the name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def unreadable_adapter(folder: Path) -> LoRAError:
    """The one error for a path that is not a readable adapter folder: missing, not a folder,
    without its two files or not readable all read the same, so a client cannot probe
    which paths exist on the server."""
    return LoRAError(
        f"{folder}: not a readable PEFT LoRA adapter folder "
        "(one with adapter_config.json and adapter_model.safetensors)"
    )


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    weights = folder / "adapter_model.safetensors"
    try:
        text = path.read_text()
        is_readable = weights.is_file() and os.access(weights, os.R_OK)
    except (OSError, UnicodeDecodeError):
        is_readable = False
    if not is_readable:
        raise unreadable_adapter(folder)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LoRAError(f"{path}: cannot parse: {exc}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{path}: expected a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{path}: peft_type {peft_type!r} is not LoRA")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if raw.get(key):
            raise LoRAError(f"{path}: {what} is not supported")
    if raw.get("bias", "none") != "none":
        raise LoRAError(f"{path}: bias {raw['bias']!r} is not supported (only 'none')")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            name = str(target).rsplit(".", 1)[-1]
            if name not in PEFT_TARGETS:
                raise LoRAError(
                    f"{path}: target module {target!r} is not a projection of this model "
                    f"(LoRA can target {', '.join(PEFT_TARGETS)})"
                )
    return raw


def load_lora_adapter(
    folder: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype, name: str = ""
) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the model; LoRAError names what is wrong."""
    folder = Path(folder)
    raw = _read_config(folder)
    weights_path = folder / "adapter_model.safetensors"
    try:
        with safe_open(str(weights_path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise LoRAError(f"{weights_path}: corrupt or unreadable safetensors file: {exc}") from None
    if not tensors:
        raise LoRAError(f"{weights_path}: holds no LoRA weights")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.fullmatch(key)
        if match is None:
            raise LoRAError(
                f"{weights_path}: unexpected tensor {key!r} (only lora_A/lora_B weights)"
            )
        module = _LAYER_MODULE.fullmatch(match["module"])
        target = PEFT_TARGETS.get(module["name"]) if module else None
        if module is None or target is None or target[0] != module["block"]:
            raise LoRAError(
                f"{weights_path}: tensor {key!r} targets {match['module']!r}, which is not a "
                f"projection of this model (LoRA can target {', '.join(PEFT_TARGETS)})"
            )
        layer = int(module["layer"])
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"{weights_path}: tensor {key!r} is for layer {layer}, but the model has "
                f"{cfg.num_layers} layers (an adapter for another base model?)"
            )
        pairs.setdefault((layer, module["name"]), {})[match["kind"]] = tensor
    layout = fused_layout(cfg)
    alpha_default = float(raw.get("lora_alpha", 8))
    rank_default = raw.get("r")
    use_rslora = bool(raw.get("use_rslora", False))
    packed: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
    max_seen = 0
    for (layer, peft_name), pair in sorted(pairs.items()):
        full = f"model.layers.{layer}.{PEFT_TARGETS[peft_name][0]}.{peft_name}"
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{weights_path}: {full} has lora_A or lora_B but not both")
        a, b = pair["lora_A"], pair["lora_B"]
        fused, slice_index = PEFT_TARGETS[peft_name][1:]
        if fused not in layout:
            raise LoRAError(
                f"{weights_path}: {full} targets the MLP, which in {cfg.architecture} is a "
                f"mixture of experts; LoRA can target {', '.join(sorted(layout))} here"
            )
        in_features, slice_outs = layout[fused]
        out_features = slice_outs[slice_index]
        rank = a.shape[0]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != in_features
            or b.shape != (out_features, rank)
        ):
            raise LoRAError(
                f"{weights_path}: {full} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this model needs ({rank}, {in_features}) and ({out_features}, {rank}) "
                "(an adapter for another base model?)"
            )
        if rank > max_rank:
            raise LoRAError(
                f"{weights_path}: {full} has rank {rank}, above --max-lora-rank {max_rank}"
            )
        declared = _pattern_value(raw.get("rank_pattern") or {}, full, rank_default)
        if declared is not None and declared != rank:  # its scaling (alpha / r) would be wrong
            raise LoRAError(
                f"{weights_path}: {full} has rank {rank}, but adapter_config.json declares "
                f"r={declared}"
            )
        for kind, tensor in (("lora_A", a), ("lora_B", b)):
            if not torch.isfinite(tensor).all():  # it would poison every row it touches
                raise LoRAError(f"{weights_path}: {full}.{kind} holds NaN or infinite values")
        max_seen = max(max_seen, rank)
        alpha = float(_pattern_value(raw.get("alpha_pattern") or {}, full, alpha_default))
        scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        if (layer, fused) not in packed:
            packed[layer, fused] = (
                torch.zeros(in_features, len(slice_outs) * max_rank),
                [torch.zeros(max_rank, out) for out in slice_outs],
            )
        a_packed, b_slices = packed[layer, fused]
        col = slice_index * max_rank
        a_packed[:, col : col + rank] = a.float().t()
        b_slices[slice_index][:rank] = b.float().t() * scaling
    weights = {key: (a.to(dtype), [b.to(dtype) for b in bs]) for key, (a, bs) in packed.items()}
    for (layer, fused), (a, bs) in weights.items():
        if not all(torch.isfinite(t).all() for t in (a, *bs)):
            raise LoRAError(
                f"{weights_path}: layer {layer} {fused}: values beyond {dtype}'s range once "
                "scaled by lora_alpha / r"
            )
    return LoRAAdapter(name or folder.name, str(folder), max_seen, weights)


class LoRAStacks:
    """Adapter weights by slot: per layer and fused projection, A and B stacked over slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.a: list[dict[str, torch.Tensor]] = []
        """Per layer: fused projection -> [num_slots, in, slices * max_rank]."""
        self.b: list[dict[str, list[torch.Tensor]]] = []
        """Per layer: fused projection -> per slice [num_slots, max_rank, slice out]."""
        for _ in range(cfg.num_layers):
            a_layer, b_layer = {}, {}
            for module, (in_features, slice_outs) in fused_layout(cfg).items():
                width = len(slice_outs) * max_rank
                a_layer[module] = torch.zeros(
                    num_slots, in_features, width, dtype=dtype, device=device
                )
                b_layer[module] = [
                    torch.zeros(num_slots, max_rank, out, dtype=dtype, device=device)
                    for out in slice_outs
                ]
            self.a.append(a_layer)
            self.b.append(b_layer)
        self.slot_modules: list[frozenset[str]] = [frozenset()] * num_slots
        """Per slot: the projections its adapter changes (the rest of the slot is zeros)."""

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put an adapter into a slot, zeroing whatever the previous one left."""
        for layer, (a_layer, b_layer) in enumerate(zip(self.a, self.b, strict=True)):
            for module in a_layer:
                entry = adapter.weights.get((layer, module))
                if entry is None:
                    a_layer[module][slot].zero_()
                    for b in b_layer[module]:
                        b[slot].zero_()
                else:
                    a_layer[module][slot].copy_(entry[0])
                    for b, value in zip(b_layer[module], entry[1], strict=True):
                        b[slot].copy_(value)
        self.slot_modules[slot] = adapter.modules

    @property
    def nbytes(self) -> int:
        a_bytes = sum(t.nbytes for layer in self.a for t in layer.values())
        return a_bytes + sum(t.nbytes for layer in self.b for ts in layer.values() for t in ts)


@dataclass
class LoRAStepState:
    """One step's adapter rows, passed explicitly through the forward like the attention metadata."""

    stacks: LoRAStacks
    first_slot: int
    """Groups are the slots ``first_slot .. first_slot + num_groups - 1``."""
    num_groups: int
    rows: torch.Tensor | None
    """[num_groups, max rows] token rows per slot (padded); None when every row of the
    step uses the one slot, in order."""
    mask: torch.Tensor | None
    """[num_groups, max rows, 1] bool: False at padding; None when there is none."""
    modules: frozenset[str]
    """Projections some adapter of this step changes; the others are skipped."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``, a fresh tensor) plus each row's adapter delta."""
        if module not in self.modules:
            return y
        first, end = self.first_slot, self.first_slot + self.num_groups
        stacks = self.stacks
        rank = stacks.max_rank
        slices = stacks.b[layer][module]
        a = stacks.a[layer][module][first:end]
        # Each slice's delta is computed apart and the slices concatenated, so that the one
        # add into the fused output is contiguous (strided in-place adds cost more than the cat).
        if self.rows is None:  # one adapter, every row
            shrunk = x @ a[0]
            parts = [shrunk[:, s * rank : (s + 1) * rank] @ b[first] for s, b in enumerate(slices)]
            return y.add_(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))
        rows = self.rows.view(-1)
        shrunk = torch.bmm(x.index_select(0, rows).view(self.num_groups, -1, x.shape[-1]), a)
        parts = [
            torch.bmm(shrunk[..., s * rank : (s + 1) * rank], b[first:end])
            for s, b in enumerate(slices)
        ]
        delta = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if self.mask is not None:
            # Padding rows point at row 0 (another request's) and may run through a slot no
            # row of this step uses: select, not multiply, so an inf or NaN there (inf * 0)
            # can never reach that row.
            delta = torch.where(self.mask, delta, torch.zeros((), dtype=delta.dtype))
        return y.index_add_(0, rows, delta.view(-1, y.shape[-1]))
