"""Metrics: Prometheus collectors for the server (vLLM-compatible names, ``tokenmill:`` prefix)."""

from tokenmill.metrics.prometheus import ServerMetrics

__all__ = ["ServerMetrics"]
