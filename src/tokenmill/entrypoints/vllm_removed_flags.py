"""``vllm serve`` flags that earlier vLLM releases had and vLLM 0.32 dropped.

Deployment scripts outlive releases, so a command line written for an older vLLM still
carries them. Rather than ending in ``unrecognized arguments``, each is either accepted with
a deprecation warning, where it cannot change what is served (``harmless``), or refused in
one line that names what replaced it (``replaced``). ``vllm_compat`` adds them to the serve
parser beside vLLM 0.32's own flags and judges them with those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["flag", "value"]
Fate = Literal["harmless", "replaced"]


@dataclass(frozen=True)
class RemovedFlag:
    """One dropped flag: how it parses, and what giving it does here."""

    flag: str
    kind: Kind
    fate: Fate
    note: str
    """Why it is harmless, or what replaced it (said in the warning or the refusal)."""

    @property
    def dest(self) -> str:
        return "vllm_removed_" + self.flag.removeprefix("--").replace("-", "_")

    def message(self) -> str:
        if self.fate == "harmless":
            return f"{self.flag} was removed from vLLM and is ignored: {self.note}"
        return f"{self.flag} was removed from vLLM: {self.note}"


REMOVED_FLAGS: tuple[RemovedFlag, ...] = (
    RemovedFlag(
        "--disable-log-requests",
        "flag",
        "harmless",
        "requests are not logged unless --enable-log-requests is given (vLLM's replacement)",
    ),
    RemovedFlag(
        "--swap-space",
        "value",
        "harmless",
        "there is no CPU swap space; a preempted request is recomputed, as in vLLM's V1 engine",
    ),
    RemovedFlag(
        "--preemption-mode",
        "value",
        "harmless",
        "a preempted request is always recomputed, as in vLLM's V1 engine",
    ),
    RemovedFlag(
        "--num-scheduler-steps",
        "value",
        "harmless",
        "multi-step scheduling is gone from vLLM; every step is scheduled",
    ),
    RemovedFlag(
        "--multi-step-stream-outputs",
        "flag",
        "harmless",
        "multi-step scheduling is gone from vLLM; every step streams",
    ),
    RemovedFlag("--use-v2-block-manager", "flag", "harmless", "that block manager is the only one"),
    RemovedFlag(
        "--scheduler-delay-factor",
        "value",
        "harmless",
        "waiting requests are scheduled on the next step",
    ),
    RemovedFlag(
        "--disable-async-output-proc",
        "flag",
        "harmless",
        "outputs are processed after each step",
    ),
    RemovedFlag(
        "--tokenizer-pool-size",
        "value",
        "harmless",
        "tokenization runs on the server's tokenizer threads (--max-concurrent-tokenizations)",
    ),
    RemovedFlag("--tokenizer-pool-type", "value", "harmless", "there is no tokenizer pool"),
    RemovedFlag(
        "--max-seq-len-to-capture",
        "value",
        "harmless",
        "CUDA graph capture sizes are --max-cudagraph-capture-size now; CPUs capture none",
    ),
    RemovedFlag(
        "--enable-reasoning",
        "flag",
        "harmless",
        "reasoning content is separated whenever --reasoning-parser is given",
    ),
    RemovedFlag(
        "--guided-decoding-backend",
        "value",
        "replaced",
        "use --structured-outputs-config '{\"backend\": ...}' (structured outputs run on "
        "llguidance here)",
    ),
    RemovedFlag(
        "--task",
        "value",
        "replaced",
        "use --runner pooling --convert embed (or classify/score) for a pooling model; "
        "generation needs no flag",
    ),
    RemovedFlag(
        "--speculative-model",
        "value",
        "replaced",
        'use --speculative-config \'{"model": ..., "num_speculative_tokens": N}\'',
    ),
    RemovedFlag(
        "--num-speculative-tokens",
        "value",
        "replaced",
        'use --speculative-config \'{"method": ..., "num_speculative_tokens": N}\'',
    ),
    RemovedFlag(
        "--rope-scaling", "value", "replaced", "use --hf-overrides '{\"rope_scaling\": ...}'"
    ),
    RemovedFlag("--rope-theta", "value", "replaced", "use --hf-overrides '{\"rope_theta\": ...}'"),
    RemovedFlag(
        "--enable-prompt-adapter",
        "flag",
        "replaced",
        "prompt adapters were removed from vLLM, with no replacement; LoRA adapters "
        "(--enable-lora) are the supported kind",
    ),
)
