"""Metrics: Prometheus collectors for the server (vLLM-compatible names, ``tokenmill:`` prefix)."""

from tokenmill.metrics.prometheus import ChoiceTiming, RequestTiming, ServerMetrics

__all__ = ["ChoiceTiming", "RequestTiming", "ServerMetrics"]
