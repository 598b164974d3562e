"""Measurement: ``tokenmill bench serve|offline|compare`` and ``tokenmill verify``.

metrics (the maths), arrivals and datasets (the workload), client, server_metrics, target
and serve (load-testing an OpenAI-compatible endpoint), offline and offline_backends
(in-process engines), compare and report (the decision report), verify (token-exact
agreement with transformers), cli (the flags). This module owns ``MissingExtraError``:
httpx and matplotlib come with the ``bench`` extra, and bench code names it when one is
missing.
"""

BENCH_EXTRA_INSTALL = "pip install 'tokenmill[bench]'"
"""How to install what the bench tools need beyond serving (httpx, matplotlib)."""


class MissingExtraError(ImportError):
    """A dependency of the bench tools is not installed; the message says which extra brings it."""

    def __init__(self, module: str) -> None:
        super().__init__(
            f"{module} is not installed; the bench tools need it: {BENCH_EXTRA_INSTALL}",
            name=module,
        )
