"""The registry's layout is the one description of a family: load, counts and sizing agree."""

from __future__ import annotations

import pytest
import torch

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.model import attention_backend as ab
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import load_model
from tokenmill.model.registry import ARCHITECTURES, expected_tensors, weight_layout


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_num_params_is_the_loaded_models_parameter_count(make_model, family: str) -> None:
    folder = make_model(family)
    cfg = ModelConfig.from_folder(folder)
    model = load_model(folder, torch.float32, torch.device("cpu"), 64, prepack=False)
    loaded = sum(p.numel() for p in model.parameters())  # a tied head shares the embedding
    assert cfg.num_params == loaded


def test_layout_sources_are_exactly_the_checkpoints_tensors(make_model) -> None:
    from safetensors import safe_open

    folder = make_model("qwen2")
    cfg = ModelConfig.from_folder(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert set(expected_tensors(cfg)) == names
    targets = [spec.target for spec in weight_layout(cfg)]
    assert len(targets) == len(set(targets))


def test_every_registered_architecture_names_an_importable_model_class() -> None:
    import importlib

    for spec in ARCHITECTURES.values():
        module, _, name = spec.model_class.partition(":")
        assert hasattr(importlib.import_module(module), name), spec.name


class CountingBackend(ab.TorchSDPABackend):
    """The SDPA backend, counting calls: proves the model attends only through its backend."""

    name = "counting"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.num_metadata = self.num_forward = 0
        self._in_rope = False

    def build_metadata(self, batch: ab.StepBatch):
        self.num_metadata += 1
        return super().build_metadata(batch)

    def forward(self, layer, q, k, v, kv_cache, meta):
        self.num_forward += not self._in_rope  # forward_rope's fallback counted there
        return super().forward(layer, q, k, v, kv_cache, meta)

    def forward_rope(self, layer, positions, rope, q, k, v, kv_cache, meta):
        """The entry the decoder calls (RoPE fused with the KV write on the CPU kernels)."""
        self.num_forward += 1
        self._in_rope = True
        try:
            return super().forward_rope(layer, positions, rope, q, k, v, kv_cache, meta)
        finally:
            self._in_rope = False


def test_model_attends_through_its_backend_once_per_layer(make_model, monkeypatch) -> None:
    backend = CountingBackend(torch.device("cpu"))
    monkeypatch.setattr(ab, "default_attention_backend", lambda device: backend)
    import tokenmill.model.loader as loader

    monkeypatch.setattr(loader, "default_attention_backend", lambda device: backend)
    llm = LLM(str(make_model("llama")), dtype="float32", max_model_len=64)
    before_meta, before_fwd = backend.num_metadata, backend.num_forward
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    steps = backend.num_metadata - before_meta
    assert steps == 3  # one prefill step, two decode steps
    assert backend.num_forward - before_fwd == steps * llm.engine.model_config.num_layers
