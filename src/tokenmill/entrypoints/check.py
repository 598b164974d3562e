"""``tokenmill check MODEL``: the pre-deployment compatibility check, without starting a server.

Reads the folder the way the engine would (config.json through ``ModelConfig``, the
checkpoint's headers through the loader's own name and shape checks, the tokenizer) and
reports whether tokenmill can serve it and why not: the architecture and its
implementation, dtype, parameter count and weight bytes per precision, chat template and
special tokens, context length and RoPE scaling, and which features apply. ``--parity``
adds a short greedy run against transformers. Exit status 0 when the model can be served
(and, with ``--parity``, agrees), 1 otherwise; ``--json`` prints the report for scripts.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.errors import TokenmillError

PRECISIONS = (("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4"))
"""(dtype, quantization) pairs whose weight bytes the report lists."""


@dataclass
class ParityResult:
    """Greedy tokenmill against greedy transformers, both in float32."""

    num_prompts: int
    max_tokens: int
    num_identical: int
    """Prompts whose continuations are token-identical."""
    first_divergence: list[int | None]
    """Per prompt: index of the first differing token, None when identical."""
    min_agreement: float

    @property
    def agreement(self) -> float:
        return self.num_identical / self.num_prompts if self.num_prompts else 0.0

    @property
    def passed(self) -> bool:
        return self.agreement >= self.min_agreement


@dataclass
class CheckReport:
    """Everything ``tokenmill check`` found about one model folder."""

    model: str
    servable: bool
    architecture: str | None = None
    implementation: str = "unsupported"
    """``native`` (a registry entry), ``transformers`` (the fallback) or ``unsupported``."""
    reason: str = ""
    problems: list[str] = field(default_factory=list)
    """One line per problem that stops serving, naming the file and field or tensor."""
    dtype: str | None = None
    num_params: int | None = None
    weight_bytes: dict[str, int] = field(default_factory=dict)
    """``dtype[+quantization]`` -> bytes at the model's context length."""
    context_length: int | None = None
    rope_scaling: str | None = None
    sliding_window_layers: int = 0
    num_experts: int = 0
    chat_template: bool = False
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    features: dict[str, Any] = field(default_factory=dict)
    parity: dict[str, Any] | None = None

    def lines(self) -> list[str]:
        verdict = "servable" if self.servable else "NOT servable"
        out = [f"{self.model}: {verdict}"]
        out.append(f"  {'architecture':<22} {self.architecture} ({self.implementation})")
        if self.reason:
            out.append(f"  {'why':<22} {self.reason}")
        for problem in self.problems:
            out.append(f"  {'problem':<22} {problem}")
        if self.num_params is not None:
            out.append(
                f"  {'parameters':<22} {self.num_params / 1e6:.1f}M (checkpoint dtype {self.dtype})"
            )
            for name, nbytes in self.weight_bytes.items():
                out.append(f"  {'weights ' + name:<22} {nbytes / 2**20:,.1f} MiB")
            out.append(
                f"  {'context length':<22} {self.context_length} (RoPE scaling: {self.rope_scaling or 'none'})"
            )
            if self.sliding_window_layers:
                out.append(f"  {'sliding window':<22} {self.sliding_window_layers} layer(s)")
            if self.num_experts:
                out.append(f"  {'experts':<22} {self.num_experts}")
        out.append(f"  {'chat template':<22} {'yes' if self.chat_template else 'no'}")
        for name, token in self.special_tokens.items():
            out.append(f"  {name:<22} {token}")
        for name, value in self.features.items():
            out.append(f"  {name:<22} {value}")
        if self.parity is not None and "top1_agreement" in self.parity:
            p = self.parity
            out.append(
                f"  {'parity (' + p['dtype'] + ')':<22} top-1 agreement "
                f"{p['top1_agreement'] * 100:.1f}% (required {p['min_top1'] * 100:.0f}%), mean KL "
                f"{p['mean_kl']:.4f} against transformers float32, teacher-forced "
                f"({'pass' if p['passed'] else 'FAIL'})"
            )
        elif self.parity is not None:
            out.append(
                f"  {'parity (' + self.parity['dtype'] + ')':<22} "
                f"{self.parity['num_identical']}/{self.parity['num_prompts']} "
                f"prompts identical over {self.parity['max_tokens']} greedy tokens "
                f"({'pass' if self.parity['passed'] else 'FAIL'})"
            )
        return out


def _tools_parser(template: str | None) -> str | None:
    """The ``--tool-call-parser`` a chat template's tool-call format suggests, if any."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


def _inspect_tokenizer(folder: Path, report: CheckReport) -> None:
    from tokenmill.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.from_pretrained(folder)
    except (TokenmillError, OSError, ValueError) as exc:
        report.problems.append(f"{folder}: tokenizer: {exc}")
        return
    report.chat_template = tokenizer.has_chat_template
    backend = tokenizer.backend
    for name, token_id in (
        ("bos_token", tokenizer.bos_token_id),
        ("eos_token", tokenizer.eos_token_id),
        ("pad_token", tokenizer.pad_token_id),
    ):
        report.special_tokens[name] = None if token_id is None else backend.id_to_token(token_id)
    report.features["tools parser"] = _tools_parser(tokenizer.chat_template) or "none found"


def transformers_greedy(
    folder: str | Path,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: Any,
    device: str = "cpu",
) -> list[list[int]]:
    """transformers' ``generate`` on ``folder``: greedy, EOS ignored, exactly ``max_tokens``
    new tokens per prompt, one prompt at a time (no padding to differ from ours), on ``device``.

    The reference every parity check compares tokenmill's greedy tokens with.
    """
    import torch
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.to(device).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            res = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(res[0, len(prompt) :].tolist())
    del model
    return outs


def _run_parity(
    folder: Path, num_prompts: int, max_tokens: int, min_agreement: float, vocab: int
) -> ParityResult:
    """Greedy continuations of a few random-token prompts from both sides, in float32."""
    import torch

    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.entrypoints.llm import LLM

    rng = random.Random(0)
    high = max(5, min(vocab, 1000))
    prompts = [
        [rng.randrange(4, high) for _ in range(rng.randint(4, 24))] for _ in range(num_prompts)
    ]
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    reference = transformers_greedy(folder, prompts, max_tokens, torch.float32)
    divergence: list[int | None] = [
        next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        for got, want in zip(ours, reference, strict=True)
    ]
    return ParityResult(
        num_prompts,
        max_tokens,
        sum(d is None for d in divergence),
        divergence,
        min_agreement,
    )


def build_check(
    model: str,
    parity: bool = False,
    parity_prompts: int = 3,
    parity_tokens: int = 16,
    parity_min_agreement: float | None = None,
    parity_dtype: str = "auto",
) -> CheckReport:
    """Inspect ``model`` (a folder, or ``demo``) the way the engine would load it."""
    from tokenmill.model import sizing
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.registry import ARCHITECTURES, lookup
    from tokenmill.model.source import resolve_model_path

    folder = resolve_model_path(model)
    report = CheckReport(model=model, servable=False)
    parity_args = (parity, parity_prompts, parity_tokens, parity_min_agreement, parity_dtype)
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
        archs = raw.get("architectures") or []
        report.architecture = archs[0] if archs else None
    except (OSError, json.JSONDecodeError) as exc:
        report.problems.append(f"{config_path}: cannot read: {exc}")
        report.reason = "no readable config.json"
        return report
    if report.architecture not in ARCHITECTURES:
        native_problem = ""
        try:
            lookup(report.architecture, str(config_path))
        except TokenmillError as exc:
            native_problem = str(exc)
        try:
            cfg = ModelConfig.from_folder(folder, "auto")  # the fallback's structural checks
        except TokenmillError as exc:
            report.problems += [p for p in (native_problem, str(exc)) if p]
            report.reason = (
                "tokenmill has no native implementation of this architecture, and the "
                "Transformers fallback cannot run it"
            )
            _inspect_tokenizer(folder, report)
            return report
        return _check_fallback(folder, report, cfg, parity_args)
    report.implementation = "native"
    try:
        cfg = ModelConfig.from_folder(folder)
    except TokenmillError as exc:
        report.problems.append(str(exc))
        report.reason = "config.json asks for something the native decoder cannot honour"
        _inspect_tokenizer(folder, report)
        return report
    report.dtype = cfg.torch_dtype
    report.num_params = cfg.num_params
    report.context_length = cfg.max_position_embeddings
    report.rope_scaling = cfg.rope_scaling["rope_type"] if cfg.rope_scaling else None
    report.sliding_window_layers = sum(w is not None for w in cfg.sliding_windows)
    report.num_experts = cfg.num_experts
    for dtype, quantization in PRECISIONS:
        name = dtype if quantization is None else f"{dtype}+{quantization}"
        report.weight_bytes[name] = sizing.weight_bytes(
            cfg, dtype, cfg.max_position_embeddings, quantization
        )
    report.features = {
        "quantization": "int8, int4 (weight-only, CPU)",
        "lora": ", ".join(sorted(_lora_targets(cfg))),
        "static kv": "yes" if not cfg.is_moe else "yes (decode step runs eagerly: MoE routing)",
        "prefix caching": "yes",
    }
    _inspect_tokenizer(folder, report)
    try:
        from tokenmill.model.loader import check_checkpoint

        check_checkpoint(folder, cfg)
    except TokenmillError as exc:
        report.problems.append(str(exc))
    if report.problems:
        report.reason = "the folder cannot be loaded as it is"
        return report
    report.servable = True
    _maybe_parity(folder, report, cfg.vocab_size, parity_args)
    return report


REDUCED_PRECISION_MIN_TOP1 = 0.9
"""--parity's default required top-1 agreement where serve runs a reduced precision."""


def _maybe_parity(
    folder: Path, report: CheckReport, vocab: int, parity_args: tuple[Any, ...]
) -> None:
    """With ``--parity``: the comparison decides whether the model is servable.

    It checks the dtype ``serve`` would run (``--dtype auto`` resolved as serve does): in
    float32 token for token against transformers; in a reduced precision by teacher-forced
    top-1 agreement and KL against float32 transformers (``bench/verify.py``), since exact
    greedy text is no fair test of any reduced precision.
    """
    parity, num_prompts, num_tokens, min_agreement, dtype = parity_args
    if not parity:
        return
    from tokenmill.bench.verify import run_precision_check, served_dtype

    requested, dtype = dtype, served_dtype(str(folder), dtype)
    if dtype != "float32":
        precision = run_precision_check(
            str(folder),
            # the engine gets the request itself: with ``auto`` a GGUF file's blocks run on the
            # int kernels, as in `serve`; an explicit dtype dequantizes them
            {"dtype": requested, "model_impl": "auto"},
            max_tokens=num_tokens,
            num_prompts=num_prompts,
            min_top1=REDUCED_PRECISION_MIN_TOP1 if min_agreement is None else min_agreement,
        )
        report.parity = {"dtype": dtype, **precision.to_dict()}
        report.servable = precision.passed
        if not precision.passed:
            report.reason = f"{dtype} next-token choices differ from transformers float32's"
        return
    min_agreement = 1.0 if min_agreement is None else min_agreement
    result = _run_parity(folder, num_prompts, num_tokens, min_agreement, vocab)
    report.parity = {
        "dtype": dtype,
        **asdict(result),
        "agreement": result.agreement,
        "passed": result.passed,
    }
    report.servable = result.passed
    if not result.passed:
        report.reason = "greedy outputs differ from transformers"


def _check_fallback(
    folder: Path, report: CheckReport, cfg: Any, parity_args: tuple[Any, ...]
) -> CheckReport:
    """A model only the Transformers fallback runs: its facts and the fallback's features.

    Without ``--parity`` the verdict rests on the fallback's structural checks; the probe
    against Transformers' eager run needs the weights and runs when the model loads (which
    ``--parity`` does).
    """
    from tokenmill.model import sizing

    report.implementation = "transformers"
    report.reason = (
        "no native implementation: runs through the Transformers fallback (--model-impl auto)"
    )
    report.dtype = cfg.torch_dtype
    report.num_params = cfg.num_params
    report.context_length = cfg.max_position_embeddings
    for dtype in ("float32", "bfloat16"):
        report.weight_bytes[dtype] = cfg.num_params * sizing.DTYPE_BYTES[dtype]
    report.features = {
        "quantization": "no (Transformers fallback)",
        "lora": "no (Transformers fallback)",
        "static kv": "yes (decode step runs eagerly: Transformers fallback)",
        "prefix caching": "yes",
    }
    _inspect_tokenizer(folder, report)
    if report.problems:
        report.reason = "the folder cannot be loaded as it is"
        return report
    report.servable = True
    _maybe_parity(folder, report, cfg.vocab_size, parity_args)
    return report


def _lora_targets(cfg: Any) -> set[str]:
    from tokenmill.model.lora import PEFT_TARGETS
    from tokenmill.model.registry import lora_layout

    fused = set(lora_layout(cfg))
    return {name for name, (_, module, _) in PEFT_TARGETS.items() if module in fused}


def add_check_parser(sub: Any) -> None:
    """Register ``tokenmill check`` on the top-level subcommands."""
    check = sub.add_parser(
        "check",
        help="check that a model folder can be served, before deploying it",
        description="Pre-deployment compatibility check: architecture and implementation, "
        "parameters and weight bytes per precision, chat template, special tokens, context "
        "length, RoPE scaling and the features that apply. Exits 0 when the model can be "
        "served, 1 otherwise. Nothing is started; only headers are read unless --parity.",
    )
    check.add_argument("model", help="Hugging Face model folder, or 'demo'")
    check.add_argument(
        "--parity",
        action="store_true",
        help="also compare against transformers (loads both), in the dtype serve runs: "
        "float32 token for token, a reduced precision by teacher-forced top-1 agreement and KL",
    )
    check.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="--parity: the dtype checked (auto: what serve runs here; the CPU dtype rule)",
    )
    check.add_argument("--parity-prompts", type=int, default=3, help="--parity: prompts to compare")
    check.add_argument(
        "--parity-tokens", type=int, default=16, help="--parity: greedy tokens per prompt"
    )
    check.add_argument(
        "--parity-min-agreement",
        type=float,
        default=None,
        help="--parity: float32, the share of prompts that must match token for token "
        "(default 1.0); a reduced precision, the required top-1 agreement (default 0.9)",
    )
    check.add_argument("--json", action="store_true", help="print the report as JSON")
    check.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    """Print the report; exit status 0 if the model can be served, 1 if not."""
    from tokenmill.errors import ConfigError

    for name in ("parity_prompts", "parity_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if args.parity_min_agreement is not None and not 0.0 <= args.parity_min_agreement <= 1.0:
        raise ConfigError("--parity-min-agreement must be between 0 and 1")
    report = build_check(
        args.model,
        parity=args.parity,
        parity_prompts=args.parity_prompts,
        parity_tokens=args.parity_tokens,
        parity_min_agreement=args.parity_min_agreement,
        parity_dtype=args.dtype,
    )
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print("\n".join(report.lines()))
    return 0 if report.servable else 1
