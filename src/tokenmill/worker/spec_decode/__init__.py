"""Speculative decoding's proposers, on the workers: the contract and its registry
(``base.py``), prompt lookup (``ngram.py``) and a draft model (``draft_model.py``)."""

from __future__ import annotations

from tokenmill.worker.spec_decode.base import (
    PROPOSERS,
    Proposer,
    ProposerContext,
    build_proposer,
    register_proposer,
)
from tokenmill.worker.spec_decode.draft_model import DraftModelProposer
from tokenmill.worker.spec_decode.ngram import NgramProposer

register_proposer("ngram", NgramProposer)
register_proposer("draft_model", DraftModelProposer, charges_budget=True)

__all__ = [
    "PROPOSERS",
    "DraftModelProposer",
    "NgramProposer",
    "Proposer",
    "ProposerContext",
    "build_proposer",
    "register_proposer",
]
