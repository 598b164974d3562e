"""The Transformers fallback (``--model-impl transformers``): greedy fp32 parity with
transformers ``generate`` on architectures tokenmill does not implement natively, through the
same scheduler (batching, chunked prefill, prefix caching, preemption, both KV strategies),
a native family forced through it, and the refusals at start-up."""

from __future__ import annotations

import logging
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fallback_models import build_fallback_model
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import ConfigError, ModelLoadError

MAX_NEW = 10


@pytest.fixture(scope="session")
def make_fallback_model(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> Callable[..., Path]:
    """``make_fallback_model(arch, **config overrides) -> folder``, cached per argument set."""
    cache: dict[tuple, Path] = {}

    def make(arch: str, seed: int = 0, **overrides: Any) -> Path:
        key = (arch, seed, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{arch}-model")
            cache[key] = build_fallback_model(folder, tokenizer_dir, arch, seed, **overrides)
        return cache[key]

    return make


def _prompts(vocab: int, num: int, seed: int, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(num)]


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2", "opt"])
@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7], ids=["batched", "chunked"])
def test_batched_parity_with_transformers(
    make_fallback_model, reference_greedy, arch: str, max_num_batched_tokens: int
) -> None:
    """Mixed-length prompts in one batch, whole or in 7-token chunks, as transformers alone."""
    folder = make_fallback_model(arch)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert llm.engine.model_config.model_impl == "transformers"
    prompts = _prompts(llm.tokenizer.vocab_size, 8, seed=2)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_prefix_caching_and_preemption_keep_parity(
    make_fallback_model, reference_greedy, arch: str
) -> None:
    """A shared prefix is served from cached blocks, a KV pool of 12 blocks forces
    preemption and recompute, and every output still equals transformers'."""
    folder = make_fallback_model(arch)
    rng = random.Random(5)
    prefix = [rng.randrange(4, 500) for _ in range(40)]
    prompts = [
        prefix + [rng.randrange(4, 500) for _ in range(rng.randint(1, 20))] for _ in range(8)
    ]
    max_new = 24
    expected, _ = reference_greedy(folder, prompts, max_new)
    bytes_per_token = 2 * 2 * 64 * 4  # K and V, 2 layers, 4 heads x 16, fp32
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=12 * 16 * bytes_per_token,
    )
    assert llm.engine.kv_manager.num_blocks == 12
    first = llm.generate(prompts[:1], _greedy(max_new), use_tqdm=False)
    rest = llm.generate(prompts[1:], _greedy(max_new), use_tqdm=False)
    assert rest[0].num_cached_tokens == 32  # two full blocks of the shared prefix reused
    assert llm.engine.stats.num_prefix_hit_tokens > 0
    assert llm.engine.stats.num_preemptions > 0
    assert _tokens(first + rest) == expected


def test_sliding_window_beyond_the_window(make_fallback_model, reference_greedy) -> None:
    """StarCoder2 with an 8-token window, prompts far longer than it, in chunks of 16: each
    layer's ``sliding_window`` reaches tokenmill's attention mask."""
    folder = make_fallback_model("starcoder2")
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_batched_tokens=16)
    prompts = _prompts(llm.tokenizer.vocab_size, 3, seed=4, max_len=80)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected


def test_static_kv_decodes_eagerly_with_parity(
    make_fallback_model, reference_greedy, caplog
) -> None:
    folder = make_fallback_model("gpt_neox")
    prompts = _prompts(500, 5, seed=3)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.llm_engine"):
        llm = LLM(
            str(folder), dtype="float32", max_model_len=128, max_num_seqs=2, kv_cache="static"
        )
    assert llm.engine.runner.compiled_decode is None
    assert "runs the decode step eagerly (Transformers' modeling code" in caplog.text
    assert _tokens(llm.generate(prompts, _greedy(), use_tqdm=False)) == expected


def test_prompt_logprobs_match_transformers(make_fallback_model, reference_greedy) -> None:
    """The head runs through Transformers for any rows: prompt logprobs come out right too."""
    folder = make_fallback_model("gpt2")
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    prompt = _prompts(500, 1, seed=4, max_len=30)[0] + [7, 8, 9]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = torch.tensor(
        [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    )
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_native_llama_forced_through_transformers_matches_native(make_model, caplog) -> None:
    folder = make_model("llama")
    prompts = _prompts(500, 6, seed=6)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.llm_engine"):
        native = LLM(str(folder), dtype="float32", max_model_len=256)
        assert "model implementation: native (LlamaForCausalLM is a native family" in caplog.text
        caplog.clear()
        fallback = LLM(str(folder), dtype="float32", max_model_len=256, model_impl="transformers")
        assert "model implementation: transformers (--model-impl transformers)" in caplog.text
    assert native.engine.model_config.model_impl == "native"
    assert fallback.engine.model_config.model_impl == "transformers"
    assert fallback.engine.model_config.num_params == native.engine.model_config.num_params
    want = _tokens(native.generate(prompts, _greedy(), use_tqdm=False))
    assert _tokens(fallback.generate(prompts, _greedy(), use_tqdm=False)) == want


def test_auto_logs_why_it_falls_back(make_fallback_model, caplog) -> None:
    folder = make_fallback_model("gpt_neox")
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.llm_engine"):
        LLM(str(folder), dtype="float32", max_model_len=64)
    assert (
        "model implementation: transformers (GPTNeoXForCausalLM is not a native family, so "
        "--model-impl auto runs Transformers' modeling code" in caplog.text
    )


def test_native_refuses_an_unregistered_architecture(make_fallback_model) -> None:
    folder = make_fallback_model("gpt_neox")
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported architecture 'GPTNeoXForCausalLM'.*--model-impl transformers",
    ):
        LLM(str(folder), model_impl="native")


def test_unknown_model_impl_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"--model-impl 'vllm' is not supported; choose one of auto, native, transformers",
    ):
        LLM("demo", model_impl="vllm")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"quantization": "int8"}, r"--quantization int8: the Transformers fallback"),
        ({"enable_lora": True}, r"--enable-lora: the Transformers fallback does not apply LoRA"),
        (
            {"max_model_len": 1024},
            r"--max-model-len 1024: beyond GPTNeoXForCausalLM's max_position_embeddings \(512\)",
        ),
    ],
    ids=["quantization", "lora", "max-model-len"],
)
def test_unsupported_features_are_refused_in_one_line(
    make_fallback_model, options: dict, message: str
) -> None:
    folder = make_fallback_model("gpt_neox")
    with pytest.raises(ConfigError, match=message) as info:
        LLM(str(folder), dtype="float32", **options)
    assert "\n" not in str(info.value)


def _config_only(tmp_path: Path, config: Any) -> Path:
    """A folder with just config.json: the structural refusals come before any weight is read."""
    config.save_pretrained(tmp_path)
    return tmp_path


def _refusals() -> list[tuple[str, Callable[[], Any], str]]:
    import transformers

    small = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2)
    return [
        (
            "encoder-decoder",
            lambda: transformers.T5Config(vocab_size=128, d_model=64, num_layers=2, num_heads=4),
            r"T5ForConditionalGeneration cannot run through the Transformers fallback: it is an encoder-decoder",
        ),
        (
            "state-space",
            lambda: transformers.MambaConfig(**small),
            r"MambaForCausalLM cannot run through the Transformers fallback: it has recurrent or state-space layers",
        ),
        (
            "alibi",
            lambda: transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
            r"BloomForCausalLM cannot run through the Transformers fallback: Transformers' "
            r"BloomForCausalLM does not route attention through its attention interface",
        ),
        (
            "linear-attention layers",
            lambda: transformers.Qwen3NextConfig(
                **small,
                num_attention_heads=4,
                num_key_value_heads=2,
                layer_types=["linear_attention", "full_attention"],
            ),
            r"Qwen3NextForCausalLM cannot run through the Transformers fallback: .*(recurrent|linear_attention)",
        ),
        (
            "dynamic rope",
            lambda: transformers.LlamaConfig(
                **small,
                num_attention_heads=4,
                rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
            ),
            r"LlamaForCausalLM cannot run through the Transformers fallback: dynamic NTK RoPE",
        ),
    ]


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _refusals()])
def test_unexpressible_models_are_refused_with_the_reason(tmp_path: Path, case: int) -> None:
    _, build, message = _refusals()[case]
    config = build()
    if not config.architectures:
        config.architectures = [
            {"t5": "T5ForConditionalGeneration", "mamba": "MambaForCausalLM"}.get(
                config.model_type, type(config).__name__.replace("Config", "ForCausalLM")
            )
        ]
    folder = _config_only(tmp_path, config)
    with pytest.raises(ModelLoadError, match=message) as info:
        LLM(str(folder), model_impl="transformers")
    assert "\n" not in str(info.value)


def test_attention_sinks_are_refused_by_the_probe(tmp_path: Path, tokenizer_dir: Path) -> None:
    """gpt-oss passes its attention sinks to the attention function: the probe step refuses."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    with pytest.raises(
        ModelLoadError,
        match=r"GptOssForCausalLM cannot run through the Transformers fallback: .*passes \['s_aux'\]",
    ):
        LLM(str(tmp_path), dtype="float32", max_model_len=128)


def test_native_models_never_import_transformers_or_torch_compile(make_model) -> None:
    """A native family runs without Transformers in the process (it is the fallback's only),
    and an engine that compiles nothing never imports TorchDynamo: it costs seconds of
    every start (llguidance.torch's import once did it)."""
    folder = make_model("llama")
    code = (
        "import sys\n"
        "from tokenmill import LLM, SamplingParams\n"
        f"llm = LLM({str(folder)!r}, dtype='float32', max_model_len=64)\n"
        "grammar = SamplingParams(max_tokens=2, structured_outputs={'choice': ['yes', 'no']})\n"
        "llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=2), grammar], use_tqdm=False)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_probe_refuses_logits_that_differ_from_transformers(make_fallback_model) -> None:
    """The last start-up check compares the fallback's logits on a ragged probe batch with
    Transformers' eager run: against another model's reference it must refuse."""
    import transformers

    from tokenmill.model.config import ModelConfig
    from tokenmill.model.transformers_fallback import (
        FallbackUnsupported,
        _probe,
        _probe_sequences,
        _reference_logits,
        load_transformers_model,
    )

    folder, other = make_fallback_model("gpt_neox"), make_fallback_model("gpt_neox", seed=1)
    cfg = ModelConfig.from_folder(folder, "transformers")
    cpu = torch.device("cpu")
    model = load_transformers_model(folder, cfg, torch.float32, cpu, 128)
    with torch.inference_mode():
        own = _reference_logits(
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
            _probe_sequences(cfg.vocab_size, cpu),
        )
        _probe(model, own, torch.float32, cpu)  # its own reference passes
        wrong = _reference_logits(
            transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32),
            _probe_sequences(cfg.vocab_size, cpu),
        )
        with pytest.raises(FallbackUnsupported, match="differ from Transformers' eager run"):
            _probe(model, wrong, torch.float32, cpu)


def test_beam_search_through_the_fallback_equals_native(make_model) -> None:
    """Beams fork KV blocks copy-on-write: a Llama's beams are the same both ways."""
    from tokenmill.core.beam_search_params import BeamSearchParams

    folder = make_model("llama")
    prompts = _prompts(500, 2, seed=8, max_len=20)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    outs = {
        impl: LLM(str(folder), dtype="float32", max_model_len=128, model_impl=impl).beam_search(
            prompts, params
        )
        for impl in ("native", "transformers")
    }
    beams = {
        impl: [[s.output_token_ids for s in o.sequences] for o in res] for impl, res in outs.items()
    }
    assert beams["transformers"] == beams["native"]
    assert all(len(b) == 3 for b in beams["native"])


def test_fp8_kv_and_structured_outputs_through_the_fallback(
    make_fallback_model, reference_greedy
) -> None:
    """fp8 KV: every layer's scales are calibrated at start-up and greedy stays on the fp32
    reference; a choice constraint is enforced on the fallback's logits."""
    from tokenmill.core.structured_params import StructuredOutputsParams

    folder = make_fallback_model("gpt_neox")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_dtype="fp8")
    model = llm.engine.runner.model
    assert all(state.kv_scales_calibrated for state in model.layer_states)
    prompts = _prompts(500, 4, seed=9, max_len=30)
    expected, _ = reference_greedy(folder, prompts, MAX_NEW)
    got = _tokens(llm.generate(prompts, _greedy(), use_tqdm=False))
    agree = sum(
        a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)
    )
    assert agree >= 0.8 * len(prompts) * MAX_NEW
    choice = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    texts = [o.outputs[0].text for o in llm.generate(prompts, choice, use_tqdm=False)]
    assert all(t in ("yes", "no") for t in texts)


def test_half_precision_passes_the_probe(make_fallback_model) -> None:
    """bf16 differs from the eager reference only by rounding: the probe lets it start."""
    folder = make_fallback_model("gpt2")
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=128)
    assert llm.engine.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7, 8]], _greedy(), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == MAX_NEW
