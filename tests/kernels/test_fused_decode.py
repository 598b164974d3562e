"""Decode steps through ``decode_layers`` (model/fused_decode.py) give exactly what the
layer-by-layer path gives: same tokens, same logprobs to the bit, for every projection kind
and KV dtype it takes, on each kernel table; layers it cannot encode run layer by layer."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model import fused_decode

PROMPTS = [[5 + (7 * i + 3 * j) % 90 for j in range(n)] for i, n in enumerate((3, 17, 40))]
"""Three sequences decoding together, at different context lengths (past Mistral's window
of 24 and the Gemma fixtures' 8 by the end; the first starts inside Gemma's window and
decodes past it)."""


def _generate(engine: LLMEngine, tag: str) -> dict[str, tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", prompt, params)
    done: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                assert c.logprobs is not None
                chosen = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                done[out.request_id[len(tag) :]] = (list(c.token_ids), chosen)
    return done


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    run = fused_decode.run

    def counted(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "run", counted)
    return calls


@pytest.mark.parametrize(
    ("family", "dtype", "engine_kwargs"),
    [
        ("llama", "bfloat16", {}),
        ("llama", "float32", {}),
        ("llama", "bfloat16", {"quantization": "int8"}),
        ("llama", "bfloat16", {"quantization": "int4", "quantization_group_size": 64}),
        # groups of 32 (GGUF's Q4 blocks): W8A8 on the AVX2 table, so a fixed kernel call
        ("llama", "bfloat16", {"quantization": "int4", "quantization_group_size": 32}),
        ("qwen2", "bfloat16", {"quantization": "int8", "kv_cache_dtype": "fp8"}),
        ("llama_bias", "float32", {"kv_cache_dtype": "fp8_e5m2"}),
        ("mistral", "bfloat16", {}),
    ],
)
def test_fused_decode_steps_equal_layer_by_layer(
    isa: str,
    make_model,
    monkeypatch: pytest.MonkeyPatch,
    family: str,
    dtype: str,
    engine_kwargs: dict,
) -> None:
    if engine_kwargs.get("quantization_group_size") == 32 and isa != "avx2":
        pytest.skip("groups of 32 are weight-only (no fixed kernel call) off the AVX2 table")
    _check_fused_equals_layered(make_model, monkeypatch, family, dtype, engine_kwargs)


@pytest.mark.parametrize(
    ("family", "dtype", "engine_kwargs"),
    [
        # per-head q/k norm
        ("qwen3", "bfloat16", {"quantization": "int8"}),
        ("qwen3", "float32", {}),
        # sandwich norms with 1 + weight, per-head q/k norm, GELU-tanh, sliding layers
        # (window 8) with a RoPE base of their own
        ("gemma3", "bfloat16", {}),
        ("gemma3", "float32", {}),
        ("gemma3", "bfloat16", {"quantization": "int8", "kv_cache_dtype": "fp8"}),
        ("gemma3", "bfloat16", {"quantization": "int4", "quantization_group_size": 64}),
        # Gemma 2: sandwich norms, GELU-tanh, sliding layers and attention logit soft-capping
        ("gemma2", "bfloat16", {"quantization": "int8"}),
        ("gemma2", "float32", {}),
        # OLMo 2: post-norm placement (the running state into each sublayer, its output
        # normalised before the add), q/k norm over all heads
        ("olmo2", "bfloat16", {}),
        ("olmo2", "float32", {}),
        ("olmo2", "bfloat16", {"quantization": "int8"}),
    ],
)
def test_fused_decode_of_q_k_norm_and_sandwich_layers_equals_layer_by_layer(
    isa: str,
    threads: int,
    make_model,
    monkeypatch: pytest.MonkeyPatch,
    family: str,
    dtype: str,
    engine_kwargs: dict,
) -> None:
    _check_fused_equals_layered(
        make_model, monkeypatch, family, dtype, {**engine_kwargs, "num_threads": threads}
    )


def _check_fused_equals_layered(
    make_model, monkeypatch: pytest.MonkeyPatch, family: str, dtype: str, engine_kwargs: dict
) -> None:
    calls = _fused_calls(monkeypatch)
    config = EngineConfig(
        model=str(make_model(family)),
        dtype=dtype,
        max_model_len=128,
        enable_prefix_caching=False,  # both runs prefill alike
        **engine_kwargs,
    )
    engine = LLMEngine(config)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    layered = _generate(engine, "layered")
    assert calls[0] == 0
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    fused = _generate(engine, "fused")
    assert calls[0] >= 11  # every decode step after the three prompts' prefill
    assert fused == layered


def test_gemma3_sliding_layers_are_encoded_with_their_own_rope(make_model) -> None:
    engine = LLMEngine(EngineConfig(model=str(make_model("gemma3")), dtype="bfloat16"))
    model = engine.executor.driver_worker.model
    fused = fused_decode.encode(model.layers, torch.bfloat16, model.local_rope)
    assert fused is not None
    sliding, full = fused.layers  # the fixture's layer types
    assert sliding.window == 8 and sliding.rope_cos is model.local_rope.cos
    assert full.window == 0 and full.rope_cos is None and full.rope_sin is None
    for layer in fused.layers:
        assert layer.activation == "gelu_tanh_and_mul" and layer.norm_offset
        assert layer.q_norm_weight is not None and layer.post_mlp_norm_weight is not None


@pytest.mark.parametrize(
    ("family", "engine_kwargs"),
    [
        ("mixtral", {}),  # a sparse MLP
    ],
)
def test_layers_it_cannot_encode_run_layer_by_layer(
    make_model, monkeypatch, family: str, engine_kwargs: dict
) -> None:
    calls = _fused_calls(monkeypatch)
    config = EngineConfig(model=str(make_model(family)), dtype="bfloat16", **engine_kwargs)
    engine = LLMEngine(config)
    assert len(_generate(engine, "r")) == len(PROMPTS)
    assert calls[0] == 0
    assert fused_decode.encode(engine.executor.driver_worker.model.layers, torch.bfloat16) is None


def test_an_encoding_serves_only_its_kernel_table_and_activation_dtype(make_model) -> None:
    """Encoded per (ISA, dtype): a process that switches tables (as these tests do) never
    calls one table's kernels with the other's weight layout."""
    import dataclasses

    from tokenmill import kernels

    engine = LLMEngine(EngineConfig(model=str(make_model("llama")), dtype="bfloat16"))
    model = engine.executor.driver_worker.model
    _generate(engine, "a")
    assert list(model._fused) == [(kernels.active_isa(), torch.bfloat16)]
    fused = model._fused[(kernels.active_isa(), torch.bfloat16)]
    row = torch.empty(1, 64, dtype=torch.bfloat16)
    assert fused is not None and fused.applies(row, _cache())
    assert not fused.applies(row.float(), _cache())  # another activation dtype
    assert not dataclasses.replace(fused, isa="another table").applies(row, _cache())
    assert not fused.applies(row, _cache().half())  # a KV dtype the kernels do not read


def _cache() -> torch.Tensor:
    return torch.empty(1, 16, 2, 16, dtype=torch.bfloat16)


def test_a_step_names_live_layers_only() -> None:
    """A step passes the layers' handle; once the object is freed the handle is an error."""
    from tokenmill import kernels

    layers = kernels.decode_layers_object()
    handle = layers.handle()
    assert layers.handle() == handle and kernels.decode_layers_object().handle() != handle
    x, ints = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="1 layers need 1 K and V caches"):
        layers.add_layer(*_layer_fields())
        kernels.decode_layers(x, ints, ints, ints, ints, ints, ints, [], [], handle)
    del layers
    with pytest.raises(RuntimeError, match="no DecodeLayers object with handle"):
        kernels.decode_layers(x, ints, ints, ints, ints, ints, ints, [], [], handle)


def _layer_fields() -> tuple[
    dict[str, torch.Tensor], dict[str, int], dict[str, float], dict[str, str]
]:
    w = torch.ones(8, dtype=torch.bfloat16)
    tensors = {"input_norm_weight": w, "post_attn_norm_weight": w, "kv_scales": torch.ones(2)}
    ints = {
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 8,
        "window": 0,
        "norm_offset": 0,
        "qk_norm_full": 0,
    }
    floats = {
        "input_norm_eps": 1e-5,
        "post_attn_norm_eps": 1e-5,
        "scale": 1.0,
        "logit_softcap": 0.0,
    }
    return tensors, ints, floats, {"activation": "silu_and_mul", "norm_placement": "pre"}


def test_optional_fields_come_in_pairs() -> None:
    """A q norm needs its k norm and a RoPE table both halves; the norms are the ones the
    placement has (a sandwich both MLP norms, post-norm no input norm); the activation is one
    the C++ side calls."""
    from tokenmill import kernels

    tensors, ints, floats, strings = _layer_fields()
    w = tensors["input_norm_weight"]
    pre_mlp = ({**tensors, "pre_mlp_norm_weight": w}, {**floats, "pre_mlp_norm_eps": 1e-6})
    post_mlp = ({**tensors, "post_mlp_norm_weight": w}, {**floats, "post_mlp_norm_eps": 1e-6})
    cases = [
        ({**tensors, "q_norm_weight": w}, {**floats, "q_norm_eps": 1e-6}, strings, "come together"),
        ({**tensors, "rope_cos": torch.ones(4, 8)}, floats, strings, "come together"),
        (*pre_mlp, strings, "pre_mlp_norm comes with sandwich norms only"),
        (*pre_mlp, {**strings, "norm_placement": "sandwich"}, "post_mlp_norm comes with sandwich"),
        (*post_mlp, {**strings, "norm_placement": "post"}, "an input_norm comes with pre and"),
        (*post_mlp, {**strings, "norm_placement": "mid"}, "pre, sandwich or post, got mid"),
    ]
    for t, f, s, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernels.decode_layers_object().add_layer(t, ints, f, s)
    with pytest.raises(RuntimeError, match="silu_and_mul or gelu_tanh_and_mul, got relu"):
        kernels.decode_layers_object().add_layer(
            tensors, ints, floats, {**strings, "activation": "relu"}
        )
