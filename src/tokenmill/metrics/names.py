"""Series names, labels and buckets shared by tokenmill's and vLLM's metric families.

vLLM's buckets and label names are kept so that percentiles, dashboards and alert rules
compare across the two servers.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST

PREFIX = "tokenmill:"
VLLM_PREFIX = "vllm:"
VLLM_LABELS = ["model_name", "engine"]
VLLM_ENGINE = "0"
"""vLLM's ``engine`` label: the data-parallel engine index; one engine here."""
CONTENT_TYPE = CONTENT_TYPE_LATEST
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20, 50)

# vLLM's buckets, so percentiles compare across the two servers.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1
