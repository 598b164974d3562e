"""LoRARequest: which adapter a request runs with (vLLM's ``LoRARequest``; no torch here).

The integer id is the adapter's identity inside the engine: its weights are cached under
it, and prefix-cache blocks are keyed by it, so two adapters never share KV. A server that
unloads an adapter and loads another under the same name gives it a fresh id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder to run a request with."""

    lora_name: str
    lora_int_id: int
    """Unique per adapter contents, >= 1 (0 means the base model)."""
    lora_path: str
    base_model_name: str | None = None
    """The model it was trained on, as the server lists it as ``parent`` (informative)."""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_salt(self) -> str:
        """What this adapter adds to prefix-cache keys."""
        return f"lora:{self.lora_int_id}"
