"""The data-parallel flags of ``tokenmill serve`` (vLLM's names where vLLM has one)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")


def add_data_parallel_args(
    parser: argparse.ArgumentParser, group_for: Callable[[str], Any] | None = None
) -> None:
    """``--data-parallel-size`` and ``--data-parallel-backend`` in vLLM's group, the rest ours."""
    vllm_group = (group_for("--data-parallel-size") if group_for else None) or parser
    vllm_group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas, each with its own model copy and KV cache, behind one front end "
        "that routes each request to the replica most likely to hold its prefix",
    )
    backend_group = (group_for("--data-parallel-backend") if group_for else None) or parser
    backend_group.add_argument(
        "--data-parallel-backend",
        "-dpb",
        "--backend",
        dest="data_parallel_backend",
        choices=["mp", "ray"],
        default="mp",
        help="mp: replicas are child processes supervised by this one; ray: a Ray Serve "
        "application (pip install 'tokenmill[ray]'), replicas placed and restarted by Ray",
    )
    group = parser.add_argument_group("data parallel (tokenmill)")
    group.add_argument(
        "--dp-routing",
        choices=ROUTING_POLICIES,
        default="prefix",
        help="how the front end picks a replica: prefix (the replica that was sent the "
        "prompt's longest chain of cached blocks, else the least loaded), least_loaded, "
        "or round_robin",
    )
    group.add_argument(
        "--dp-max-load-imbalance",
        type=int,
        default=8,
        help="prefix routing gives way to load when the prefix's replica has this many more "
        "requests in flight than the least loaded one",
    )
    group.add_argument(
        "--dp-max-blocks-per-replica",
        type=int,
        default=1 << 16,
        help="block hashes the front end remembers per replica (LRU); about a replica's KV "
        "cache size in blocks",
    )
    group.add_argument(
        "--dp-route-prefix-chars",
        type=int,
        default=16384,
        help="characters of a prompt tokenized to route it (only its leading blocks matter)",
    )
    group.add_argument(
        "--dp-retry-timeout",
        type=float,
        default=30.0,
        help="seconds a request that has not started waits for a live replica (one died, "
        "all are loading) before it gets 503",
    )
    group.add_argument(
        "--ray-max-replicas",
        type=int,
        default=None,
        help="with --data-parallel-backend ray: let Ray autoscale the engine replicas on "
        "ongoing requests between --data-parallel-size and this many (default: fixed)",
    )
    group.add_argument(
        "--dp-health-interval",
        type=float,
        default=0.5,
        help="seconds between the supervisor's checks of each replica (process and /health; "
        "Ray's health_check_period_s with --backend ray)",
    )
    group.add_argument(
        "--dp-health-timeout",
        type=float,
        default=5.0,
        help="seconds a replica's /health (and a connection to it) may take before the replica "
        "counts as not ready (Ray's health_check_timeout_s with --backend ray)",
    )
    group.add_argument(
        "--dp-max-restart-backoff",
        type=float,
        default=30.0,
        help="longest wait before restarting a replica that keeps exiting (the wait doubles "
        "from 0.5 s with each consecutive failure)",
    )
    group.add_argument(
        "--dp-ready-timeout",
        type=float,
        default=600.0,
        help="with --backend ray: seconds a new replica may take to load its model before Ray "
        "counts it as failed and replaces it",
    )
    group.add_argument(
        "--ray-proxy-timeout",
        type=float,
        default=60.0,
        help="with --backend ray: seconds Ray Serve's HTTP proxy may take to answer its ready "
        "and health checks (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S and "
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S, 5 and 10 s in Ray; on a busy small machine "
        "Ray killed the proxy after three late answers); those variables, when set, win",
    )
    group.add_argument(
        "--dp-metrics-push-interval",
        type=float,
        default=2.0,
        help="with --backend ray: seconds between each replica's pushes of its /metrics to "
        "the ingress",
    )


def check_data_parallel_args(args: argparse.Namespace) -> None:
    from tokenmill.errors import ConfigError

    for name, low in (
        ("data_parallel_size", 1),
        ("dp_max_load_imbalance", 0),
        ("dp_max_blocks_per_replica", 1),
        ("dp_route_prefix_chars", 1),
    ):
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be >= {low}, got {getattr(args, name)}")
    for name in (
        "dp_retry_timeout",
        "dp_health_interval",
        "dp_health_timeout",
        "dp_max_restart_backoff",
        "dp_ready_timeout",
        "dp_metrics_push_interval",
        "ray_proxy_timeout",
    ):
        if getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if getattr(args, "data_parallel_backend", "mp") == "ray":
        # Ray's HTTP proxy listens, not tokenmill: these would be silently ignored there.
        given = [
            flag
            for name, flag in (
                ("ssl_keyfile", "--ssl-keyfile"),
                ("ssl_certfile", "--ssl-certfile"),
                ("ssl_ca_certs", "--ssl-ca-certs"),
                ("ssl_ciphers", "--ssl-ciphers"),
                ("uds", "--uds"),
            )
            if getattr(args, name, None)
        ]
        if getattr(args, "ssl_cert_reqs", 0):
            given.append("--ssl-cert-reqs")
        if getattr(args, "allow_runtime_lora_updating", False):
            given.append("--allow-runtime-lora-updating")  # one replica would get each call
        if given:
            raise ConfigError(
                f"{', '.join(given)}: not supported with --data-parallel-backend ray (Ray Serve's "
                "HTTP proxy listens: terminate TLS in front of it; runtime LoRA updates would "
                "reach one replica: use --lora-modules, or --backend mp)"
            )
