"""Speculative decoding, the torch-free half: its config (parsed once), the methods, the
policy, and the n-gram scan the proposer's index is held to.

A proposer (``worker/spec_decode``) guesses the next few tokens of a running request on the
workers; the engine asks for as many as the policy and the proposer allow (a count), the
scheduler schedules that many after the request's last token, like a chunk, and the worker
verifies them in one forward (``tokenmill.sampling.speculative``). The policy shrinks
proposals as the running batch grows, since a full batch already keeps the machine busy
and rejected tokens are compute thrown away. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenmill.core.request import Request
from tokenmill.errors import ConfigError

METHODS: set[str] = {"ngram", "draft_model"}
"""``--speculative-config`` methods a proposer is registered for (the worker's
``spec_decode`` registry adds its names here; core cannot import it)."""
BUDGETED_METHODS: set[str] = {"draft_model"}
"""Methods whose proposer runs forwards of its own that count in a step's token budget
(the scheduler's ``_fit_draft``): a draft model's catch-up and drafting."""


def register_method(name: str, *, charges_budget: bool = False) -> None:
    """Make ``name`` a valid ``method`` (its proposer is registered on the worker side)."""
    METHODS.add(name)
    if charges_budget:
        BUDGETED_METHODS.add(name)
    else:
        BUDGETED_METHODS.discard(name)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config``, with vLLM's field names."""

    method: str = "ngram"
    """``ngram`` (prompt lookup) or ``draft_model`` (a smaller model with the same tokenizer)."""
    num_speculative_tokens: int = 3
    """Tokens proposed per request per step (k); the target verifies k + 1 positions."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix (in tokens) looked up in the request's prompt + output."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix worth a proposal."""
    model: str | None = None
    """draft_model: the draft's model folder."""
    disable_by_batch_size: int | None = None
    """No proposals while more requests than this run (vLLM's field); default: 8."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"--speculative-config: method {self.method!r} is not supported; choose one of "
                f"{', '.join(sorted(METHODS))}"
            )
        if self.num_speculative_tokens < 1:
            raise ConfigError("--speculative-config: num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        if self.method == "draft_model" and not self.model:
            raise ConfigError("--speculative-config: method draft_model needs a model folder")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError("--speculative-config: disable_by_batch_size must be >= 1")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """Parse the JSON object; a ``model`` without a method means ``draft_model`` (as vLLM)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown field(s) {unknown}; valid fields: {sorted(names)}"
            )
        values = dict(values)
        if "method" not in values:
            values["method"] = "draft_model" if values.get("model") else "ngram"
        if values["method"] == "ngram" and values.get("model"):
            raise ConfigError("--speculative-config: method ngram takes no model")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"--speculative-config: {exc}") from None

    @property
    def max_batch_size(self) -> int:
        return self.disable_by_batch_size or 8

    @property
    def charges_budget(self) -> bool:
        """Whether the proposer's own forwards count in a step's token budget."""
        return self.method in BUDGETED_METHODS


def num_tokens_to_propose(config: SpeculativeConfig, num_running: int) -> int:
    """The policy: k while at most half of ``disable_by_batch_size`` requests run, then
    fewer, linearly down to 1 at ``disable_by_batch_size``, and none above it."""
    limit = config.max_batch_size
    k = config.num_speculative_tokens
    if num_running > limit:
        return 0
    half = max(1, limit // 2)
    if num_running <= half:
        return k
    return max(1, round(k * (limit - num_running + 1) / (limit - half + 1)))


def max_verify_rows(config: SpeculativeConfig, max_num_seqs: int) -> int:
    """The most rows a step of decodes and verifications can have under the policy
    (``num_running`` requests, each its last token plus the policy's drafts): the largest
    batch the ``static`` strategy's compiled step must take to keep such steps compiled."""
    return max(
        n * (num_tokens_to_propose(config, n) + 1)
        for n in range(1, min(max_num_seqs, config.max_batch_size) + 1)
    )


def ngram_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    of ``tokens`` (between min_n and max_n long); [] when no suffix recurs."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        # Latest match first: recent text is the likeliest to be copied again.
        for start in range(num - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


def max_draft_tokens(request: Request) -> int:
    """Draft tokens that could still be kept: one token per step is produced anyway, so
    ``max_tokens`` and the context limit leave room for this many more."""
    left = request.max_output_tokens - request.num_output_tokens - 1
    left_ctx = request.max_total_tokens - request.num_tokens - 1
    return max(0, min(left, left_ctx))
