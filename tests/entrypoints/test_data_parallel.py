"""``tokenmill serve --data-parallel-size 2``: the real front end and two real replicas.

One server for the module (two demo replicas, one thread each). The supervisor's periodic
check is made rare (``--dp-health-interval 300``) so that a killed replica is found by the
request that cannot reach it: the test gates the failure instead of racing the supervisor.
The kill test runs next to last: it leaves one replica restarted (and checks that a runtime
LoRA loaded before is loaded on it again); the SIGTERM test ends the server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.entrypoints.conftest import MAIN_KEY, ServerHandle, start_server
from tokenmill.bench.server_metrics import sum_by_label
from tokenmill.entrypoints.data_parallel.args import check_data_parallel_args
from tokenmill.entrypoints.data_parallel.metrics import merge_replica_metrics
from tokenmill.entrypoints.data_parallel.route_key import RouteKeys
from tokenmill.entrypoints.data_parallel.supervisor import replica_args
from tokenmill.errors import ConfigError
from tokenmill.model.demo import demo_model_path
from tokenmill.tokenizer.tokenizer import Tokenizer

REPLICA = "x-tokenmill-replica"
SYSTEM = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "told the children stories about the stars, the wind and the long roads of the world."
)
SHARED = (  # routed by no other test: routing remembers every prefix it sent
    "The little dog ran into the garden every morning to look for the red ball that the "
    "girl had thrown over the fence, and every morning the cat watched him from the wall. "
) * 2
SHARED_C = (
    "In the morning the baker opened his shop and the smell of warm bread filled the whole "
    "street, so that the children stopped on their way to school to look in the window. "
) * 2
SHARED_B = (
    "A tall ship sailed past the lighthouse at night while the keeper wrote in his book "
    "about the storms of the winter and the birds that came back with the first warm days. "
) * 2


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    handle = start_server(
        tmp_path_factory.mktemp("dp"),
        "--data-parallel-size",
        "2",
        "--dp-health-interval",
        "300",
        "--max-model-len",
        "1024",
        "--max-request-body-bytes",
        "65536",
        "--enable-lora",
        "--allow-runtime-lora-updating",
        "--shutdown-timeout",
        "0",  # the SIGTERM test: replicas cut their streams off at once
        "--tokenizer",
        "demo",  # resolved by the front end as the engine resolves it
    )
    try:
        wait_all_ready(handle)
        yield handle
    finally:
        handle.stop()


def dp_state(handle: ServerHandle) -> dict:
    return httpx.get(f"{handle.base_url}/dp/replicas", headers=handle.headers(), timeout=10).json()


def replicas(handle: ServerHandle) -> list[dict]:
    return dp_state(handle)["replicas"]


def wait_all_ready(handle: ServerHandle, timeout_s: float = 180.0) -> list[dict]:
    """Every replica ready and idle, and every admission ticket back (none leaked by the
    requests before: finished, refused, cut off or left by their client)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = dp_state(handle)
        if state["admitted"] == 0 and all(
            r["ready"] and r["in_flight"] == 0 for r in state["replicas"]
        ):
            return state["replicas"]
        time.sleep(0.1)
    pytest.fail(f"replicas not ready: {dp_state(handle)}\n{handle.log()}")


def series(handle: ServerHandle, name: str) -> dict[str, float]:
    """Values of a metric by its ``replica`` label ('' for the aggregate)."""
    text = httpx.get(f"{handle.base_url}/metrics", headers=handle.headers(), timeout=10).text
    return sum_by_label(text, name, "replica")


def series_with(handle: ServerHandle, name: str, label: str) -> dict[str, float]:
    """``series`` of the samples whose labels include ``label``."""
    text = httpx.get(f"{handle.base_url}/metrics", headers=handle.headers(), timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            replica = re.search(r'replica="(\d+)"', line)
            key = replica.group(1) if replica else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def routed_by_prefix(handle: ServerHandle) -> float:
    text = httpx.get(f"{handle.base_url}/metrics", headers=handle.headers(), timeout=10).text
    pattern = r'dp_requests_routed_total\{replica="\d+",reason="prefix"\} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text))


def complete(http: httpx.Client, prompt: str, max_tokens: int = 2) -> httpx.Response:
    response = http.post(
        "/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens}
    )
    assert response.status_code == 200, response.text
    return response


def test_metrics_merge_labels_each_replica_and_sums() -> None:
    text = (
        "# HELP x_total Things.\n# TYPE x_total counter\n"
        'x_total{model_name="m"} %s\n'
        "# HELP kv_perc Use.\n# TYPE kv_perc gauge\nkv_perc %s\n"
    )
    merged = merge_replica_metrics({0: text % (2, 0.5), 1: text % (3, 0.25)})
    assert 'x_total{model_name="m"} 5.0' in merged
    assert 'x_total{model_name="m",replica="0"} 2.0' in merged
    assert 'x_total{model_name="m",replica="1"} 3.0' in merged
    assert "kv_perc 0.375" in merged  # a fraction is averaged, not summed


def test_ray_refuses_flags_its_proxy_would_ignore_and_tp_shares_the_cores() -> None:
    from tokenmill.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "demo", "--backend", "ray", "--ssl-cert-reqs", "2"])
    with pytest.raises(ConfigError, match="--ssl-cert-reqs: not supported with"):
        check_data_parallel_args(args)
    args = parser.parse_args(["serve", "demo", "-dp", "2", "--dp-health-timeout", "0"])
    with pytest.raises(ConfigError, match="--dp-health-timeout must be > 0"):
        check_data_parallel_args(args)
    args = parser.parse_args(["serve", "demo", "--backend", "ray", "--ray-proxy-timeout", "0"])
    with pytest.raises(ConfigError, match="--ray-proxy-timeout must be > 0"):
        check_data_parallel_args(args)
    args = argparse.Namespace(
        data_parallel_size=2, tensor_parallel_size=2, num_threads=None, api_keys=[]
    )
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    assert replica_args(args, 0, "/tmp/x.sock").num_threads == max(1, cores // 4)


def test_the_front_end_listens_as_the_single_server_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mTLS (``--ssl-cert-reqs 2``), ciphers and the h11 head limits reach the front end's
    uvicorn (it used to drop ``ssl_cert_reqs``: client certificates were not required)."""
    from tokenmill.entrypoints.cli import build_parser
    from tokenmill.entrypoints.data_parallel import frontend
    from tokenmill.entrypoints.openai.server import _JSONErrorH11Protocol

    seen: list = []
    monkeypatch.setattr(frontend.FrontServer, "run", lambda self: seen.append(self.config))
    argv = ["serve", "demo", "-dp", "2", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]
    argv += ["--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2", "--ssl-ciphers", "ECDHE"]
    argv += ["--max-header-bytes", "12345"]
    assert frontend.run_data_parallel(build_parser().parse_args(argv)) == 0
    (config,) = seen
    assert (config.ssl_cert_reqs, config.ssl_ciphers, config.ssl_ca_certs) == (2, "ECDHE", "ca.pem")
    assert config.http is _JSONErrorH11Protocol and config.h11_max_incomplete_event_size == 12345


def test_a_failing_check_is_logged_and_the_watch_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio

    from tokenmill.entrypoints.data_parallel.supervisor import ReplicaSupervisor

    args = argparse.Namespace(
        data_parallel_size=2, dp_health_timeout=1.0, dp_max_restart_backoff=1.0
    )
    checked: list[int] = []

    async def run() -> None:
        supervisor = ReplicaSupervisor(args, str(tmp_path), 0.01, print, print)

        async def check(replica) -> None:  # replica 0's check is broken, replica 1's is fine
            checked.append(replica.index)
            if replica.index == 0:
                raise ValueError("boom")
            if checked.count(1) >= 3:
                supervisor._is_stopping = True

        supervisor._check = check  # type: ignore[method-assign]
        await asyncio.wait_for(supervisor._watch(), 10)
        for replica in supervisor.replicas:
            await replica.client.aclose()

    asyncio.run(run())
    assert checked.count(1) >= 3  # the loop went on after replica 0's failures
    assert "replica 0: the supervisor's check failed" in caplog.text and "boom" in caplog.text


def test_front_end_tokens_are_the_replicas_own(dp: ServerHandle) -> None:
    keys = RouteKeys(Tokenizer.from_pretrained(demo_model_path()), max_chars=10_000)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    with dp.http() as http:
        served = http.post("/tokenize", json={"model": "demo", "messages": messages}).json()
        plain = http.post("/tokenize", json={"model": "demo", "prompt": SYSTEM}).json()
    chat_body = json.dumps({"model": "demo", "messages": messages}).encode()
    assert keys.token_ids("/v1/chat/completions", chat_body) == served["tokens"]
    prompt_body = json.dumps({"model": "demo", "prompt": SYSTEM}).encode()
    assert keys.token_ids("/v1/completions", prompt_body) == plain["tokens"]
    cut = RouteKeys(keys.tokenizer, max_chars=40).token_ids("/v1/completions", prompt_body)
    assert cut and plain["tokens"][: len(cut)] == cut  # a cut prompt keeps its leading tokens


def test_official_clients_and_auth_through_the_front_end(dp: ServerHandle) -> None:
    client = dp.openai()
    assert [m.id for m in client.models.list().data] == ["demo"]
    chat = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    chunks = list(client.completions.create(model="demo", prompt=SYSTEM, max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{dp.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):  # the replica's own validation, passed through
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    assert httpx.get(f"{dp.base_url}/health", headers=dp.headers()).status_code == 200
    assert MAIN_KEY not in dp.log()


def test_the_front_end_gates_answer_in_the_api_shape(dp: ServerHandle) -> None:
    """The single server's gates in front: a body over the limit is refused from its
    Content-Length (413, not read), a bad key gets 401 with WWW-Authenticate, and on
    /v1/messages both are in Anthropic's shape."""
    with dp.http() as http:
        big = http.post(
            "/v1/completions", json={"model": "demo", "prompt": "x" * 70_000, "max_tokens": 1}
        )
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert REPLICA not in big.headers  # refused before any replica saw it
        bad = http.post("/v1/completions", headers={"Authorization": "Bearer nope"}, json={})
        assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer"
        assert bad.json()["error"]["code"] == "invalid_api_key"
        body = {"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        anth = http.post("/v1/messages", headers={"Authorization": "Bearer nope"}, json=body)
        assert anth.status_code == 401 and anth.json()["type"] == "error"
        assert anth.json()["error"]["type"] == "authentication_error"
        anth = http.post("/v1/messages", json={**body, "system": "x" * 70_000})
        assert anth.status_code == 413 and anth.json()["error"]["type"] == "request_too_large"


def answered_by(dp: ServerHandle, model: str) -> set[str]:
    """Replicas that answered requests for ``model``; each request must succeed. Pairs of
    concurrent requests: the least loaded routing sends the second of each elsewhere."""
    seen: set[str] = set()
    with dp.http() as http, ThreadPoolExecutor(2) as pool:
        for i in range(5):
            bodies = [{"model": model, "prompt": f"lora {i}{j}", "max_tokens": 8} for j in "ab"]
            answers = list(pool.map(lambda b: http.post("/v1/completions", json=b), bodies))
            for answer in answers:
                assert answer.status_code == 200, answer.text
                seen.add(answer.headers[REPLICA])
            if len(seen) == 2:
                break
    return seen


def test_runtime_lora_reaches_every_replica(dp: ServerHandle, make_adapter) -> None:
    adapter = make_adapter(Path(demo_model_path()), seed=31)
    with dp.http() as http:
        load = {"lora_name": "dp-lora", "lora_path": str(adapter)}
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
        again = http.post("/v1/load_lora_adapter", json=load)  # every replica refuses it
        assert again.status_code == 400 and "already been loaded" in again.text
        other = {"lora_name": "dp-gone", "lora_path": str(adapter)}
        assert http.post("/v1/load_lora_adapter", json=other).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "dp-gone"}).is_success
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "dp-gone"})
        assert gone.status_code == 404
    assert answered_by(dp, "dp-lora") == {"0", "1"}


def test_a_shared_prefix_stays_on_the_replica_that_cached_it(dp: ServerHandle) -> None:
    """Two long prefixes, interleaved one request at a time: each stays on one replica, and
    they are spread over both (round robin would split each prefix, least-loaded would put
    both on replica 0)."""
    wait_all_ready(dp)
    before = series(dp, "vllm:prefix_cache_hits_total")
    prefixed = routed_by_prefix(dp)
    order = ["a", "b", "a", "a", "b", "a", "b", "b"]
    homes: dict[str, set[str]] = {"a": set(), "b": set()}
    with dp.http() as http:
        for i, group in enumerate(order):
            prefix = SHARED if group == "a" else SHARED_B
            homes[group].add(complete(http, f"{prefix} story {i}").headers[REPLICA])
    assert len(homes["a"]) == 1 and len(homes["b"]) == 1 and homes["a"] != homes["b"]
    hits = series(dp, "vllm:prefix_cache_hits_total")
    assert all(hits[r] > before.get(r, 0.0) for r in ("0", "1"))
    assert hits[""] == hits["0"] + hits["1"]
    assert routed_by_prefix(dp) - prefixed >= 6  # every request after each prefix's first


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(dp: ServerHandle) -> None:
    """Gated on the request being in flight at its replica, the client closes its socket:
    the replica aborts the request (counted as ``abort``, where finishing would be ``length``)."""
    wait_all_ready(dp)
    name = "vllm:request_success_total"
    aborted = series_with(dp, name, 'finished_reason="abort"').get("", 0.0)
    body = json.dumps(
        {"model": "demo", "prompt": "leave", "max_tokens": 1000, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {MAIN_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", dp.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while not any(r["in_flight"] for r in replicas(dp)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while series_with(dp, name, 'finished_reason="abort"').get("", 0.0) == aborted:
        assert time.monotonic() < deadline, "the replica did not abort the request"
        time.sleep(0.1)
    wait_all_ready(dp)


def test_a_killed_replica_loses_no_request_that_had_not_started(dp: ServerHandle) -> None:
    wait_all_ready(dp)
    with dp.http() as http:
        body = {"model": "demo", "prompt": f"{SHARED_C} 0", "max_tokens": 800, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            victim = int(stream.headers[REPLICA])
            pid = replicas(dp)[victim]["pid"]
            lines = stream.iter_lines()
            next(lines)
            os.kill(pid, signal.SIGKILL)  # in flight: this one gets an error
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert any('"replica_failed"' in line for line in rest)
        # Not started: the prefix sends them to the dead replica first (the supervisor has not
        # looked yet); each is retried on the live one.
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: complete(http, f"{SHARED_C} {i}"), range(1, 5)))
    assert {a.headers[REPLICA] for a in answers} == {str(1 - victim)}
    assert series(dp, "tokenmill:dp_requests_retried_total")[""] >= 1
    assert series(dp, "tokenmill:dp_requests_failed_in_flight_total")[""] == 1
    state = wait_all_ready(dp)  # the supervisor restarted it
    assert state[victim]["restarts"] == 1 and state[victim]["pid"] != pid
    with dp.http() as http:
        assert complete(http, "back again").status_code == 200
    assert series(dp, "tokenmill:dp_replica_restarts_total")[str(victim)] == 1
    assert answered_by(dp, "dp-lora") == {"0", "1"}  # reloaded on the restarted replica


def test_sigterm_ends_open_streams_as_the_single_server_does(dp: ServerHandle) -> None:
    """The front end drains through the replicas' own shutdown: an open stream ends with the
    error event and ``[DONE]``, and the front end exits 0 (runs last: it ends the server)."""
    wait_all_ready(dp)
    with dp.http() as http:
        body = {"model": "demo", "prompt": "bye", "max_tokens": 800, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(lines)
            dp.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]
    assert dp.process.wait(timeout=30) == 0
