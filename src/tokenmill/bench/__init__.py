"""Measurement: ``tokenmill bench serve|offline|compare`` and ``tokenmill verify``.

metrics (the maths), arrivals and datasets (the workload), client, server_metrics and
serve (load-testing an OpenAI-compatible endpoint), offline and offline_backends
(in-process engines), compare and report (the decision report), verify (token-exact
agreement with transformers), cli (the flags).
"""
