"""``tokenmill verify``: do tokenmill's greedy tokens match ``transformers`` exactly?

Owns running the same prompts with greedy decoding through a reference (a plain
``transformers`` forward loop with a KV cache, one prompt at a time, so nothing but the
model's maths decides the tokens) and through tokenmill (in-process ``LLM`` or a server
URL), then reporting the exact-match rate of token sequences, where each mismatch first
diverges, and the largest difference between the two sides' log-probabilities of the
same token. EOS is ignored on both sides so sequences have equal length.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tokenmill.bench import MissingExtraError
from tokenmill.bench.client import auth_headers
from tokenmill.bench.offline_backends import load_transformers_model
from tokenmill.bench.target import first_served_model
from tokenmill.bench.tokenization import TokenizerLike, encode_text, load_tokenizer

try:
    import httpx
except ImportError as exc:  # in the bench extra: serving does not need it
    raise MissingExtraError("httpx") from exc

DEFAULT_PROMPTS: tuple[str, ...] = (
    "The quick brown fox",
    "Once upon a time, in a village by the sea,",
    "A tokenizer splits text into pieces, and",
    "Every morning they walked down to the harbor",
    "The river ran quietly through the valley",
    "She opened the window, and",
    "def add(a, b):",
    "1, 2, 3, 4, 5,",
)
"""Prompts used when no dataset is given: varied enough to exercise several positions."""


@dataclass
class Generation:
    """Greedy tokens of one prompt and the log-probability each side gave each token."""

    token_ids: list[Any]
    """Token ids; per-token texts when a server can only name tokens by text."""
    logprobs: list[float | None]


@dataclass
class PromptVerdict:
    """How one prompt's two generations compare."""

    index: int
    is_match: bool
    first_divergence: int | None
    """Position of the first differing token; None when the sequences are equal."""
    max_logprob_diff: float | None
    """Largest |reference - tokenmill| log-probability over the agreeing prefix."""
    reference_tokens: list[int] = field(default_factory=list)
    tokenmill_tokens: list[int] = field(default_factory=list)


@dataclass
class VerifyReport:
    """The outcome of a verify run."""

    num_prompts: int
    match_rate: float
    max_logprob_diff: float | None
    min_match: float
    prompts: list[PromptVerdict]

    @property
    def passed(self) -> bool:
        return self.match_rate >= self.min_match

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def compare_generations(
    reference: list[Generation], candidate: list[Generation], min_match: float = 1.0
) -> VerifyReport:
    """Exact-match rate, first divergence per mismatch and max logprob difference."""
    if len(reference) != len(candidate):
        raise ValueError(
            f"{len(reference)} reference generations but {len(candidate)} from tokenmill"
        )
    verdicts = []
    overall_diff: float | None = None
    for index, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        divergence = next(
            (
                i
                for i, (a, b) in enumerate(zip(ref.token_ids, cand.token_ids, strict=False))
                if a != b
            ),
            None,
        )
        if divergence is None and len(ref.token_ids) != len(cand.token_ids):
            divergence = min(len(ref.token_ids), len(cand.token_ids))
        agreeing = len(ref.token_ids) if divergence is None else divergence
        diffs = [
            abs(a - b)
            for a, b in zip(ref.logprobs[:agreeing], cand.logprobs[:agreeing], strict=False)
            if a is not None and b is not None
        ]
        prompt_diff = max(diffs) if diffs else None
        if prompt_diff is not None:
            overall_diff = prompt_diff if overall_diff is None else max(overall_diff, prompt_diff)
        verdicts.append(
            PromptVerdict(
                index, divergence is None, divergence, prompt_diff, ref.token_ids, cand.token_ids
            )
        )
    num_match = sum(v.is_match for v in verdicts)
    rate = num_match / len(verdicts) if verdicts else 0.0
    return VerifyReport(len(verdicts), rate, overall_diff, min_match, verdicts)


def run_transformers_greedy(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str = "float32",
    device: str = "cpu",
) -> list[Generation]:
    """Reference: one prompt at a time, argmax of the raw logits, EOS ignored."""
    hf_model = load_transformers_model(model, dtype, device)
    # transformers renamed ``past_key_values`` to ``cache`` (input and output); use what this version has.
    cache_name = (
        "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    )
    generations = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], device=device)
            out = hf_model(input_ids=input_ids, use_cache=True)
            tokens: list[int] = []
            logprobs: list[float | None] = []
            for step in range(max_tokens):
                step_logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.argmax(step_logprobs))
                tokens.append(token)
                logprobs.append(float(step_logprobs[token]))
                if step + 1 < max_tokens:
                    out = hf_model(
                        input_ids=torch.tensor([[token]], device=device),
                        use_cache=True,
                        **{cache_name: getattr(out, cache_name)},
                    )
            generations.append(Generation(tokens, logprobs))
    del hf_model
    return generations


def run_tokenmill_greedy(
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str = "float32",
    device: str = "cpu",
    **engine_kwargs: Any,
) -> list[Generation]:
    """tokenmill in-process, all prompts batched, greedy with ignore_eos and the sampled logprob."""
    from tokenmill.config import EngineConfig
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.engine import batch
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig.from_kwargs(model=model, dtype=dtype, device=device, **engine_kwargs)
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    ids = [str(i) for i in range(len(prompts))]
    outputs = batch.generate(engine, ids, prompts, [params] * len(prompts))
    generations = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs: list[float | None] = []
        for position, token in enumerate(completion.token_ids):
            entry = completion.logprobs[position].get(token) if completion.logprobs else None
            logprobs.append(entry.logprob if entry is not None else None)
        generations.append(Generation(list(completion.token_ids), logprobs))
    del engine
    return generations


def token_text_of(tokenizer: TokenizerLike, token_id: int) -> str:
    """The per-token text a server puts in ``logprobs.tokens`` (tokenmill's own mapping first)."""
    for name in ("id_to_token_text", "convert_ids_to_tokens"):
        method = getattr(tokenizer, name, None)
        if callable(method):
            return str(method(token_id))
    return tokenizer.decode([token_id])


def _post_completion(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    """POST, dropping ``return_tokens_as_token_ids`` once if the server rejects that extension."""
    response = client.post(url, json=body, headers=headers)
    if response.status_code == 400 and "return_tokens_as_token_ids" in response.text:
        body = {k: v for k, v in body.items() if k != "return_tokens_as_token_ids"}
        response = client.post(url, json=body, headers=headers)
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
    return response.json()


def run_server_greedy(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    max_tokens: int,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> list[Generation]:
    """Any OpenAI-compatible server: ``/v1/completions`` with token-id prompts and logprobs.

    Asks for ``return_tokens_as_token_ids`` (vLLM's extension, which tokenmill serves too)
    to get exact ids. A server without it returns each token's text instead: those
    generations hold strings, and ``run_verify`` compares them with the reference's tokens
    mapped to text the same way.
    """
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = auth_headers(api_key)
    generations = []
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for prompt in prompts:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": 1,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            }
            choice = _post_completion(client, f"{root}/v1/completions", body, headers)["choices"][0]
            logprobs = choice.get("logprobs") or {}
            tokens: list[Any] = list(logprobs.get("tokens") or [])
            if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                tokens = [int(t[len("token_id:") :]) for t in tokens]
            generations.append(
                Generation(tokens, list(logprobs.get("token_logprobs") or [None] * len(tokens)))
            )
    return generations


def build_prompt_ids(
    tokenizer: TokenizerLike, texts: list[str] | None = None, num_prompts: int | None = None
) -> list[list[int]]:
    """Token ids of the verify prompts (the defaults unless ``texts`` is given)."""
    texts = list(texts or DEFAULT_PROMPTS)
    if num_prompts is not None:
        texts = [texts[i % len(texts)] for i in range(num_prompts)]
    return [encode_text(tokenizer, t) for t in texts]


def run_verify(
    model: str,
    *,
    max_tokens: int = 32,
    texts: list[str] | None = None,
    num_prompts: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    server_url: str | None = None,
    server_model: str | None = None,
    api_key: str | None = None,
    min_match: float = 1.0,
    engine_kwargs: dict[str, Any] | None = None,
) -> VerifyReport:
    """Reference vs tokenmill on the same prompts; see ``VerifyReport.passed``.

    ``server_model`` is the name requests to ``server_url`` carry; None asks the server
    (the first of ``/v1/models``), as ``bench serve`` does.
    """
    tokenizer = load_tokenizer(model)
    prompts = build_prompt_ids(tokenizer, texts, num_prompts)
    if server_url and server_model is None:
        server_model = first_served_model(server_url, api_key)
    reference = run_transformers_greedy(model, prompts, max_tokens, dtype, device)
    if server_url:
        assert server_model is not None  # asked for above
        candidate = run_server_greedy(server_url, server_model, prompts, max_tokens, api_key)
        if any(isinstance(t, str) for g in candidate for t in g.token_ids):
            reference = [
                Generation([token_text_of(tokenizer, t) for t in g.token_ids], g.logprobs)
                for g in reference
            ]
    else:
        candidate = run_tokenmill_greedy(
            model, prompts, max_tokens, dtype, device, **(engine_kwargs or {})
        )
    return compare_generations(reference, candidate, min_match)


def served_dtype(model: str, requested: str = "auto", device: str = "cpu") -> str:
    """The dtype ``tokenmill serve`` runs ``model`` in with ``--dtype requested`` on this
    device (``auto``: the rule in ``model/cpu_dtype.py`` on a CPU), so that verify, check and
    bench offline test what serve runs."""
    if requested != "auto":
        return requested
    import torch

    from tokenmill.model.config import ModelConfig
    from tokenmill.model.loader import resolve_dtype
    from tokenmill.model.source import resolve_model_path

    cfg = ModelConfig.from_folder(resolve_model_path(model), "auto")  # native or fallback
    if device == "auto":  # bench offline's default, as the engine's worker resolves it
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return str(resolve_dtype("auto", cfg, torch.device(device))).removeprefix("torch.")


def format_verify_report(
    report: VerifyReport, decode: Callable[[list[int]], str] | None = None
) -> str:
    """The terminal summary: one line per mismatch (with text, given ``decode``) and the verdict."""
    lines = [
        f"exact match: {report.match_rate * 100:.1f}% of {report.num_prompts} prompts "
        f"(required {report.min_match * 100:.1f}%)"
    ]
    diff = "n/a" if report.max_logprob_diff is None else f"{report.max_logprob_diff:.3e}"
    lines.append(f"max |logprob difference| over agreeing tokens: {diff}")
    for v in report.prompts:
        if not v.is_match:
            pos = v.first_divergence
            ref = (
                v.reference_tokens[pos]
                if pos is not None and pos < len(v.reference_tokens)
                else None
            )
            got = (
                v.tokenmill_tokens[pos]
                if pos is not None and pos < len(v.tokenmill_tokens)
                else None
            )
            lines.append(
                f"  prompt {v.index}: diverges at token {pos} (transformers {ref}, tokenmill {got})"
            )
            if decode is not None and pos is not None:
                ids_ref = [t for t in v.reference_tokens if isinstance(t, int)]
                ids_got = [t for t in v.tokenmill_tokens if isinstance(t, int)]
                if len(ids_ref) == len(v.reference_tokens) and len(ids_got) == len(
                    v.tokenmill_tokens
                ):
                    lines.append(f"    transformers: {decode(ids_ref)!r}")
                    lines.append(f"    tokenmill:    {decode(ids_got)!r}")
    lines.append("PASS" if report.passed else "FAIL")
    return "\n".join(lines)


def save_verify_report(report: VerifyReport, path: str) -> None:
    """Write the full report, every token of both sides included, as JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=2)


# ---- reduced precision: distributions, not exact tokens -------------------------------------
@dataclass
class PrecisionReport:
    """How closely a reduced-precision engine's next-token distributions follow fp32's."""

    config: dict[str, Any]
    """The engine options measured (dtype, quantization, kv_cache_dtype, ...)."""
    num_positions: int
    top1_agreement: float
    """Fraction of positions where both sides' most likely next token is the same."""
    mean_kl: float
    """Mean KL(reference || candidate) of the next-token distribution, in nats."""
    max_kl: float
    min_top1: float
    exact_match_rate: float | None = None
    """Share of prompts whose free-running greedy text equals fp32's: reported, never judged
    (any reduced precision drifts somewhere in a long continuation, llama.cpp's f16 too)."""
    sample_reference_text: str = ""
    """The first prompt's fp32 greedy continuation, decoded."""
    sample_candidate_text: str = ""
    """tokenmill's free-running greedy continuation of the same prompt, decoded."""

    @property
    def passed(self) -> bool:
        return self.top1_agreement >= self.min_top1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def reference_logprobs(
    model: str, sequences: list[list[int]], device: str = "cpu"
) -> list[torch.Tensor]:
    """transformers in float32: log-probabilities [len - 1, vocab] of each next token."""
    hf_model = load_transformers_model(model, "float32", device)
    out = []
    with torch.inference_mode():
        for seq in sequences:
            logits = hf_model(input_ids=torch.tensor([seq], device=device)).logits[0, :-1]
            out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
    del hf_model
    return out


def compare_distributions(
    reference: list[torch.Tensor],
    candidate: list[torch.Tensor],
    first_positions: list[int],
    config: dict[str, Any],
    min_top1: float,
) -> PrecisionReport:
    """Top-1 agreement and KL over each sequence's positions from ``first_positions[i]`` on."""
    ref = torch.cat([r[f:] for r, f in zip(reference, first_positions, strict=True)])
    cand = torch.cat([c[f:] for c, f in zip(candidate, first_positions, strict=True)])
    kl = (ref.exp() * (ref - cand)).sum(dim=-1).clamp(min=0)
    agree = (ref.argmax(dim=-1) == cand.argmax(dim=-1)).float().mean()
    return PrecisionReport(
        config, len(ref), float(agree), float(kl.mean()), float(kl.max()), min_top1
    )


def run_precision_check(
    model: str,
    engine_kwargs: dict[str, Any],
    *,
    max_tokens: int = 256,
    texts: list[str] | None = None,
    num_prompts: int | None = None,
    device: str = "cpu",
    min_top1: float = 0.9,
    batch_size: int = 1,
) -> PrecisionReport:
    """Greedy fp32 continuations of the prompts, then both sides scored on them, teacher-forced.

    The candidate is tokenmill with ``engine_kwargs`` (e.g. ``quantization="int8"``) on its
    decode path (``tokenmill.engine.scoring``); the reference is transformers in float32.
    """
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.scoring import score_sequences

    tokenizer = load_tokenizer(model)
    prompts = build_prompt_ids(tokenizer, texts, num_prompts)
    continuations = run_transformers_greedy(model, prompts, max_tokens, "float32", device)
    sequences = [p + list(g.token_ids) for p, g in zip(prompts, continuations, strict=True)]
    reference = reference_logprobs(model, sequences, device)
    engine = LLMEngine(EngineConfig.from_kwargs(model=model, device=device, **engine_kwargs))
    candidate = score_sequences(engine, sequences, batch_size)
    config = {k: v for k, v in engine.config.__dict__.items() if k in _PRECISION_FIELDS}
    del engine
    first = [len(p) - 1 for p in prompts]
    report = compare_distributions(reference, candidate, first, config, min_top1)
    free_running = run_tokenmill_greedy(model, prompts, max_tokens, device=device, **engine_kwargs)
    same = [
        list(c.token_ids) == list(g.token_ids)
        for c, g in zip(continuations, free_running, strict=True)
    ]
    report.exact_match_rate = sum(same) / len(same) if same else None
    if continuations:
        report.sample_reference_text = str(tokenizer.decode(list(continuations[0].token_ids)))
        report.sample_candidate_text = str(tokenizer.decode(list(free_running[0].token_ids)))
    return report


_PRECISION_FIELDS = ("dtype", "quantization", "quantization_group_size", "kv_cache_dtype")


def format_precision_report(report: PrecisionReport) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in report.config.items())
    return "\n".join(
        [
            f"tokenmill ({shown}) against transformers float32, teacher-forced on fp32 greedy text:",
            f"  positions:       {report.num_positions}",
            f"  top-1 agreement: {report.top1_agreement * 100:.2f}% (required {report.min_top1 * 100:.1f}%)",
            f"  mean KL:         {report.mean_kl:.5f} nats (max {report.max_kl:.4f})",
            *(
                [
                    f"  exact greedy text: {report.exact_match_rate * 100:.1f}% of prompts "
                    "(reported, not judged: reduced precision drifts in long free-running text)",
                    f"  first prompt, transformers fp32: {report.sample_reference_text!r}",
                    f"  first prompt, tokenmill:         {report.sample_candidate_text!r}",
                ]
                if report.exact_match_rate is not None
                else []
            ),
            "PASS" if report.passed else "FAIL",
        ]
    )
