"""Metrics: Prometheus collectors for the server (vLLM-compatible names, ``tokenmill:`` prefix)."""

from tokenmill.metrics.prometheus import ServerMetrics
from tokenmill.metrics.timing import ChoiceTiming, RequestTiming

__all__ = ["ChoiceTiming", "RequestTiming", "ServerMetrics"]
