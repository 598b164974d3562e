"""``tokenmill check``: the pre-deployment report, its exit status and its bad-input lines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.conftest import DENSE_FAMILIES, FAMILIES, MOE_FAMILIES
from tokenmill.entrypoints.cli import main
from tokenmill.model import sizing
from tokenmill.model.config import ModelConfig


def _check(capsys, *args: str) -> tuple[int, dict]:
    code = main(["check", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("family", FAMILIES + DENSE_FAMILIES + MOE_FAMILIES)
def test_every_native_family_is_servable(make_model, capsys, family: str) -> None:
    folder = make_model(family)
    code, report = _check(capsys, str(folder))
    assert code == 0, report
    cfg = ModelConfig.from_folder(folder)
    assert report["servable"] and report["implementation"] == "native"
    assert report["architecture"] == cfg.architecture
    assert report["num_params"] == cfg.num_params
    assert report["weight_bytes"]["bfloat16+int8"] == sizing.weight_bytes(
        cfg, "bfloat16", cfg.max_position_embeddings, "int8"
    )
    assert report["chat_template"] is True  # the fixtures ship a ChatML template
    assert report["special_tokens"]["eos_token"] is not None
    assert report["num_experts"] == (4 if family in MOE_FAMILIES else 0)
    if family in MOE_FAMILIES:  # LoRA applies to attention only
        assert report["features"]["lora"] == "k_proj, o_proj, q_proj, v_proj"
    if family == "phi3":
        assert report["rope_scaling"] == "longrope"


def test_parity_reports_agreement_with_transformers(make_model, capsys) -> None:
    folder = str(make_model("gemma2"))
    code, report = _check(capsys, folder, "--parity", "--parity-tokens", "6", "--dtype", "float32")
    assert code == 0
    assert report["parity"]["dtype"] == "float32"
    assert report["parity"]["num_identical"] == report["parity"]["num_prompts"] == 3
    assert report["parity"]["first_divergence"] == [None, None, None]


def test_parity_checks_the_dtype_serve_runs(make_model, capsys) -> None:
    """Without --dtype, parity runs what `serve` would (bf16 wherever the CPU computes it or
    the AVX2 kernels read it), judged by teacher-forced agreement where it is not float32."""
    from tokenmill.bench.verify import served_dtype

    folder = str(make_model("llama"))
    served = served_dtype(folder)
    code, report = _check(capsys, folder, "--parity", "--parity-tokens", "6")
    assert report["parity"]["dtype"] == served
    if served == "float32":
        assert "num_identical" in report["parity"]
    else:
        assert report["parity"]["top1_agreement"] >= 0.9 and code == 0
        assert report["parity"]["mean_kl"] >= 0 and "exact_match_rate" in report["parity"]
    main(["check", folder, "--parity", "--parity-tokens", "6"])
    assert f"parity ({served})" in capsys.readouterr().out


def test_demo_model_text_report(capsys) -> None:
    assert main(["check", "demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("demo: servable")
    assert "LlamaForCausalLM (native)" in out
    assert "chat template          yes" in out


def _copy(make_model, tmp_path: Path, family: str = "llama") -> Path:
    dst = tmp_path / "model"
    shutil.copytree(make_model(family), dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_unsupported_architecture_exits_1_naming_what_is_supported(
    make_model, tmp_path: Path, capsys
) -> None:
    folder = _copy(make_model, tmp_path)
    _edit_config(folder, architectures=["GPTNeoXForCausalLM"])
    code, report = _check(capsys, str(folder))
    assert code == 1
    assert report["implementation"] == "unsupported"
    assert "unsupported architecture 'GPTNeoXForCausalLM'" in report["problems"][0]
    assert "MixtralForCausalLM" in report["problems"][0]
    assert str(folder / "config.json") in report["problems"][0]


def test_unknown_rope_scaling_type_is_one_line_at_check_and_at_start_up(
    make_model, tmp_path: Path, capsys
) -> None:
    folder = _copy(make_model, tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "ntk-magic", "rope_theta": 1e4, "factor": 2})
    code, report = _check(capsys, str(folder))
    assert code == 1
    (problem,) = report["problems"]
    assert "config.json" in problem and "'ntk-magic'" in problem and "longrope" in problem
    assert (
        main(["generate", "hi", "--model", str(folder)]) == 1
    )  # a model that cannot be served: exit 1, as every start-up check
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'ntk-magic' is not supported" in err


def test_bidirectional_gemma_is_refused_naming_the_field(
    make_model, tmp_path: Path, capsys
) -> None:
    folder = _copy(make_model, tmp_path, "gemma3")
    _edit_config(folder, use_bidirectional_attention=True)
    code, report = _check(capsys, str(folder))
    assert code == 1 and "use_bidirectional_attention" in report["problems"][0]


def test_unknown_activation_is_refused_naming_the_field(make_model, tmp_path: Path, capsys) -> None:
    folder = _copy(make_model, tmp_path)
    _edit_config(folder, hidden_act="relu2")
    code, report = _check(capsys, str(folder))
    assert code == 1 and "hidden_act 'relu2' is not supported" in report["problems"][0]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor"),
        (
            lambda t: t.__setitem__(
                "model.layers.0.mlp.down_proj.bias", t["model.norm.weight"].clone()
            ),
            "unexpected tensor 'model.layers.0.mlp.down_proj.bias'",
        ),
    ],
    ids=["missing", "unexpected"],
)
def test_checkpoint_problems_name_the_tensor(
    make_model, tmp_path: Path, capsys, edit, needle: str
) -> None:
    folder = _copy(make_model, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    code, report = _check(capsys, str(folder))
    assert code == 1 and not report["servable"]
    assert needle in report["problems"][0]
    assert main(["generate", "hi", "--model", str(folder)]) == 1
    assert needle in capsys.readouterr().err


def test_llama_biases_load_once_the_config_declares_them(
    make_model, tmp_path: Path, capsys
) -> None:
    """The case that used to stop with ``unexpected tensor ...down_proj.bias``."""
    code, report = _check(capsys, str(make_model("llama_bias")))
    assert (
        code == 0 and report["num_params"] > ModelConfig.from_folder(make_model("llama")).num_params
    )


def test_fallback_model_is_servable_through_transformers(
    tokenizer_dir: Path, tmp_path: Path, capsys
) -> None:
    """A GPT-NeoX checkpoint: no native family, servable through the Transformers fallback,
    with the fallback's features and, with --parity, transformers' own greedy tokens."""
    import torch
    import transformers

    from tests.fallback_models import build_fallback_model

    folder = build_fallback_model(tmp_path / "neox", tokenizer_dir, "gpt_neox")
    code, report = _check(
        capsys, str(folder), "--parity", "--parity-tokens", "6", "--dtype", "float32"
    )
    assert code == 0, report
    assert report["servable"] and report["implementation"] == "transformers"
    assert "Transformers fallback" in report["reason"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert report["num_params"] == sum(p.numel() for p in hf.parameters())
    assert report["weight_bytes"]["bfloat16"] == 2 * report["num_params"]
    assert report["features"]["quantization"].startswith("no")
    assert report["features"]["lora"].startswith("no")
    assert report["parity"]["first_divergence"] == [None, None, None]


def test_model_neither_native_nor_fallback_says_why(tmp_path: Path, capsys) -> None:
    import transformers

    config = transformers.MambaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2)
    config.architectures = ["MambaForCausalLM"]
    config.save_pretrained(tmp_path)
    code, report = _check(capsys, str(tmp_path))
    assert code == 1
    assert report["implementation"] == "unsupported"
    assert "unsupported architecture 'MambaForCausalLM'" in report["problems"][0]
    assert "recurrent or state-space layers" in report["problems"][1]
