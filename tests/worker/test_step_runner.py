"""Step runners and attention backends are chosen once at start-up, from registries: a new
one is a class and a registration, with no engine or model code touched; the start-up line
names the choice and why a faster runner was refused."""

from __future__ import annotations

import logging

import pytest
import torch

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import ConfigError
from tokenmill.model import attention_backend as ab
from tokenmill.model import fused_decode
from tokenmill.worker import step_runner as sr

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


def _generate(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def _start_up_line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step runner:")]
    assert len(lines) == 1, lines
    return lines[0]


class ToyRunner(sr.StepRunner):
    """Counts the steps it is offered and takes the decode-only ones, eagerly."""

    name = "toy"
    takes_every_step = False
    offered = 0
    taken = 0

    @classmethod
    def refusal(cls, ctx: sr.RunnerContext) -> str | None:
        return None if ctx.model.config.num_layers > 0 else "no layers"

    def forward(self, runner, inputs) -> torch.Tensor | None:
        ToyRunner.offered += 1
        if inputs.meta is None or inputs.input_ids is None or len(inputs.sample_rows) < 1:
            return None
        if len(inputs.input_ids) != len(inputs.sample_rows):  # a prefill chunk: pass it on
            return None
        ToyRunner.taken += 1
        return runner.model(
            inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, inputs.lora
        )


def test_a_registered_runner_is_chosen_first_and_takes_its_steps(
    make_model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = str(make_model("llama"))
    expected = _generate(LLM(folder, dtype="float32", max_model_len=64))
    monkeypatch.setattr(sr, "STEP_RUNNERS", list(sr.STEP_RUNNERS))
    sr.register_step_runner(ToyRunner, before=sr.CompiledRunner)
    with caplog.at_level(logging.INFO):
        llm = LLM(folder, dtype="float32", max_model_len=64)
    assert _start_up_line(caplog).startswith("step runner: toy, then fused")
    assert _generate(llm) == expected
    assert ToyRunner.taken >= 3 and ToyRunner.offered > ToyRunner.taken  # prefill passed on


class ToyBackend(ab.TorchSDPABackend):
    """SDPA, counting the layers it attends: a backend with an attention of its own."""

    name = "toy_sdpa"
    num_forward = 0

    def forward_rope(self, layer, positions, rope, q, k, v, kv_cache, meta):
        ToyBackend.num_forward += 1
        return super().forward_rope(layer, positions, rope, q, k, v, kv_cache, meta)


def test_a_registered_backend_is_selected_by_name_and_keeps_the_fused_runner_out(
    make_model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ab, "BACKENDS", dict(ab.BACKENDS))
    ab.register_attention_backend(ToyBackend)
    folder = str(make_model("llama"))
    expected = _generate(LLM(folder, dtype="float32", max_model_len=64))
    with caplog.at_level(logging.INFO):
        llm = LLM(folder, dtype="float32", max_model_len=64, attention_backend="toy_sdpa")
    line = _start_up_line(caplog)
    assert "fused: attention backend toy_sdpa attends its own way" in line
    assert "attention backend toy_sdpa on cpu" in line
    before = ToyBackend.num_forward
    assert _generate(llm) == expected
    attended = ToyBackend.num_forward - before  # every layer of every step, decodes too
    num_layers = llm.engine.model_config.num_layers
    assert attended >= 4 * num_layers and attended % num_layers == 0


def test_an_unknown_backend_is_refused_naming_the_choices(make_model) -> None:
    with pytest.raises(ConfigError, match=r"unknown attention backend 'FLASH_ATTN'.*torch_sdpa"):
        LLM(str(make_model("llama")), dtype="float32", attention_backend="FLASH_ATTN")


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("mixtral", "fused: layer 0: MLP SparseMoE"),
    ],
)
def test_the_start_up_line_names_the_layer_feature_that_keeps_fused_out(
    make_model, caplog: pytest.LogCaptureFixture, family: str, reason: str
) -> None:
    with caplog.at_level(logging.INFO):
        LLM(str(make_model(family)), dtype="bfloat16", max_model_len=64)
    line = _start_up_line(caplog)
    assert line.startswith("step runner: eager (refused compiled: ") and reason in line


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "olmo2"])
def test_q_k_norm_and_sandwich_families_run_fused(
    make_model, caplog: pytest.LogCaptureFixture, family: str
) -> None:
    """Per-head q/k norms (Qwen3, Gemma 3), sandwich norms with ``1 + weight``, GELU-tanh,
    soft-capping (Gemma 2), the sliding layers' own RoPE (Gemma 3), and post-norms with a
    q/k norm over all heads (OLMo 2) are encoded."""
    with caplog.at_level(logging.INFO):
        LLM(str(make_model(family)), dtype="bfloat16", max_model_len=64)
    assert _start_up_line(caplog).startswith("step runner: fused (refused compiled: ")


def test_no_fused_decode_runs_layer_by_layer(
    make_model, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = [0]
    run = fused_decode.run

    def counted(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(fused_decode, "run", counted)
    folder = str(make_model("llama"))
    fused = LLM(folder, dtype="bfloat16", max_model_len=64)
    expected = _generate(fused)
    assert calls[0] > 0
    calls[0] = 0
    with caplog.at_level(logging.INFO):
        layered = LLM(folder, dtype="bfloat16", max_model_len=64, fused_decode=False)
    assert _start_up_line(caplog).startswith("step runner: eager (refused compiled: ")
    assert "fused: --no-fused-decode" in _start_up_line(caplog)
    assert _generate(layered) == expected
    assert calls[0] == 0


def test_a_layered_step_says_whether_it_holds_prompt_chunks(make_model) -> None:
    """The decoder's layers run inside ``quant_base.prompt_chunks``: True while a step holds
    prompt tokens, False for a decode-only step, so that a projection's prompt-only path
    (``Int4Linear.amx_prompt_gemm_rows``) never changes what a decode step computes."""
    from tokenmill.model.quant_base import in_prompt_chunks

    llm = LLM(str(make_model("llama")), dtype="bfloat16", max_model_len=64, fused_decode=False)
    model = llm.engine.executor.driver_worker.model
    seen: list[tuple[int, bool]] = []
    model.layers[0].register_forward_hook(
        lambda module, args, out: seen.append((args[0].shape[0], in_prompt_chunks()))
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    assert seen[0] == (5, True) and seen[1:] == [(1, False), (1, False)]
    assert not in_prompt_chunks()


def test_the_fused_step_encodes_each_layer_by_name(make_model) -> None:
    """Each layer's fields and each projection's op arguments go to ``decode_layers`` by name."""
    llm = LLM(str(make_model("mistral")), dtype="bfloat16", max_model_len=64)
    model = llm.engine.executor.driver_worker.model
    fused = fused_decode.encode(model.layers, torch.bfloat16)
    assert fused is not None and len(fused.layers) == len(model.layers)
    assert fused.native.num_layers() == len(model.layers)
    cfg = llm.engine.model_config
    first = fused.layers[0]
    assert (first.num_heads, first.num_kv_heads) == (cfg.num_heads, cfg.num_kv_heads)
    assert first.window == model.layers[0].attn.window > 0  # Mistral's sliding window
    assert first.qkv.op == "gemv_bf16" and first.down.args["out_features"] == cfg.hidden_size
    assert first.down.args["packed"] is model.layers[0].mlp.down.gemv


def test_decode_layers_rejects_a_field_it_does_not_know(make_model) -> None:
    """A name the C++ side does not read is an error at encoding, not a silently wrong slot."""
    from tokenmill import kernels

    llm = LLM(str(make_model("llama")), dtype="bfloat16", max_model_len=64)
    fused = fused_decode.encode(llm.engine.executor.driver_worker.model.layers, torch.bfloat16)
    assert fused is not None
    layer = fused.layers[0]
    native = kernels.decode_layers_object()
    with pytest.raises(RuntimeError, match="no tensor 'post_attn_norm_weight'"):
        native.add_layer({}, {}, {}, {})  # the first name it misses is reported
    layer.add_to(native)
    args = dict(layer.qkv.args, weight=layer.qkv.args["packed"])
    with pytest.raises(RuntimeError, match="unexpected tensor 'weight'"):
        fused_decode.Projection(layer.qkv.op, args).add_to(native, "qkv")
    with pytest.raises(RuntimeError, match="does not call linear_bf16"):
        fused_decode.Projection("linear_bf16", {}).add_to(native, "o")
