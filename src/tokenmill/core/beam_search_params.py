"""BeamSearchParams and BeamSearchOutput: the offline ``LLM.beam_search`` API, shaped like vLLM's.

A beam search request is an ordinary request whose ``SamplingParams`` say
``use_beam_search``; these types only give the offline API vLLM's names (``beam_width``,
``BeamSearchSequence.tokens`` = prompt + generated) and validate once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.errors import InvalidRequestError


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, plus transformers' ``early_stopping``."""

    beam_width: int
    """Beams kept at every step; this many best sequences are returned."""
    max_tokens: int
    """Most generated tokens per sequence."""
    ignore_eos: bool = False
    """Do not end a beam on the EOS token."""
    temperature: float = 0.0
    """Accepted for vLLM compatibility. As in vLLM, beams are ranked by the model's raw
    log-probabilities, so it does not change the result."""
    length_penalty: float = 1.0
    """A finished beam scores sum(logprobs) / (generated tokens ** length_penalty)."""
    include_stop_str_in_output: bool = False
    """Accepted for vLLM compatibility; only false (beam search takes no stop strings)."""
    early_stopping: bool | str = False
    """True, False or "never", as in transformers."""

    def __post_init__(self) -> None:
        if self.include_stop_str_in_output:
            raise InvalidRequestError(
                "include_stop_str_in_output is not supported: beam search takes no stop strings",
                param="include_stop_str_in_output",
            )
        self.to_sampling_params()  # validates every field, naming it

    def to_sampling_params(self) -> SamplingParams:
        """The equivalent request parameters (one final output with every beam)."""
        return SamplingParams(
            n=self.beam_width,
            use_beam_search=True,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's names)."""

    tokens: list[int]
    """Prompt and generated token ids."""
    output_token_ids: list[int]
    """The generated token ids alone."""
    text: str
    """The generated text (vLLM decodes prompt and output together here)."""
    cum_logprob: float
    """Sum of the generated tokens' log-probabilities."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first (by length-penalised score)."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
