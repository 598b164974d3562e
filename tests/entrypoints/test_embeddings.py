"""``/v1/embeddings``, ``/pooling``, ``/score``, ``/rerank`` under ``--runner pooling``, and
``/ping``, ``/invocations``, ``/load``: the official ``openai`` client and raw HTTP against a
real server, embeddings checked against transformers on the same weights."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.entrypoints.conftest import ServerHandle, assert_error, start_server

ATOL = 1e-4
TEXTS = ["The sea is wide.", "A file holds bytes.", "Licence terms apply.", "x"]


@pytest.fixture(scope="module")
def pool_server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(server_log_dir, "--runner", "pooling", "--max-num-seqs", "8")
    yield handle
    handle.stop()
    assert "Traceback" not in handle.log(), handle.log()


@pytest.fixture(scope="module")
def matryoshka_server(
    demo_cache: str, server_log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    from tokenmill.model.demo import demo_model_path

    folder = tmp_path_factory.mktemp("matryoshka") / "model"
    shutil.copytree(demo_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    handle = start_server(
        server_log_dir, "--convert", "embed", "--served-model-name", "demo", model=str(folder)
    )
    yield handle
    handle.stop()


def reference(ids: list[int]) -> torch.Tensor:
    """transformers' base model on the demo weights: last token's hidden state, normalised."""
    import transformers

    from tokenmill.model.demo import demo_model_path

    model = transformers.AutoModel.from_pretrained(demo_model_path(), dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0)


def test_embeddings_match_transformers_float_and_base64(pool_server: ServerHandle) -> None:
    client = pool_server.openai()
    floats = client.embeddings.create(model="demo", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    # The SDK asks for base64 by default and decodes it: the same numbers.
    default = client.embeddings.create(model="demo", input=TEXTS)
    for a, b in zip(floats.data, default.data, strict=True):
        assert torch.allclose(torch.tensor(a.embedding), torch.tensor(b.embedding))
    with pool_server.http() as http:
        total = 0
        for text, data in zip(TEXTS, floats.data, strict=True):
            ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
            total += len(ids)
            got = torch.tensor(data.embedding)
            assert torch.allclose(got, reference(ids), atol=ATOL), (
                (got - reference(ids)).abs().max()
            )
        assert floats.usage.prompt_tokens == floats.usage.total_tokens == total
        raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
        encoded = raw.json()["data"][0]["embedding"]
        decoded = base64.b64decode(encoded)
        values = struct.unpack(f"<{len(decoded) // 4}f", decoded)
        assert torch.allclose(torch.tensor(values), torch.tensor(floats.data[0].embedding))


def test_a_batch_of_32_equals_one_at_a_time(pool_server: ServerHandle) -> None:
    client = pool_server.openai()
    before = pool_server.wait_idle().get("tokenmill:request_success_total", 0.0)
    inputs = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(32)]
    batch = client.embeddings.create(model="demo", input=inputs, encoding_format="float")
    assert len(batch.data) == 32
    for i in (0, 13, 31):
        one = client.embeddings.create(model="demo", input=inputs[i], encoding_format="float")
        assert torch.allclose(
            torch.tensor(batch.data[i].embedding), torch.tensor(one.data[0].embedding), atol=1e-5
        )
    ids = [[5, 6, 7], [8, 9]]  # token ids are inputs too
    by_ids = client.embeddings.create(model="demo", input=ids, encoding_format="float")
    assert by_ids.usage.prompt_tokens == 5
    # Every input is one engine request, counted in the metrics as generation is.
    after = pool_server.wait_idle()["tokenmill:request_success_total"]
    assert after - before == 32 + 3 + 2


def test_dimensions_only_on_a_matryoshka_model(
    pool_server: ServerHandle, matryoshka_server: ServerHandle
) -> None:
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        pool_server.openai().embeddings.create(model="demo", input="x", dimensions=16)
    client = matryoshka_server.openai()
    full = client.embeddings.create(model="demo", input="The sea.", encoding_format="float")
    cut = client.embeddings.create(
        model="demo", input="The sea.", dimensions=16, encoding_format="float"
    )
    assert len(cut.data[0].embedding) == 16
    # Cut first, normalised after (as vLLM does): the direction of the first 16 values.
    head = torch.tensor(full.data[0].embedding[:16])
    assert torch.allclose(torch.tensor(cut.data[0].embedding), head / head.norm(), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="16, 32"):
        client.embeddings.create(model="demo", input="x", dimensions=20)


def test_pooling_score_and_rerank(pool_server: ServerHandle) -> None:
    with pool_server.http() as http:
        pooled = http.post("/pooling", json={"input": TEXTS[:2]}).json()
        assert (
            pooled["object"] == "list" and [d["object"] for d in pooled["data"]] == ["pooling"] * 2
        )
        embedded = http.post("/v1/embeddings", json={"input": TEXTS[:2]}).json()
        assert pooled["data"][0]["data"] == embedded["data"][0]["embedding"]
        score = http.post("/score", json={"text_1": TEXTS[0], "text_2": [TEXTS[0], TEXTS[1]]})
        scores = [d["score"] for d in score.json()["data"]]
        a, b = (torch.tensor(d["embedding"]) for d in embedded["data"])
        assert scores[0] == pytest.approx(1.0, abs=1e-5)
        assert scores[1] == pytest.approx(float(a @ b / (a.norm() * b.norm())), abs=1e-5)
        rerank = http.post(
            "/rerank", json={"query": TEXTS[1], "documents": TEXTS, "top_n": 2}
        ).json()
        results = rerank["results"]
        assert len(results) == 2 and results[0]["index"] == 1
        assert results[0]["document"]["text"] == TEXTS[1]
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert_error(
            http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c"]}), 400, "text_2"
        )
        assert_error(http.post("/rerank", json={"query": "q", "documents": []}), 400, "documents")


def test_bad_input_and_the_wrong_runner(pool_server: ServerHandle, server: ServerHandle) -> None:
    with pool_server.http() as http:
        for body, param in [
            ({}, "input"),
            ({"input": []}, "input"),
            ({"input": ""}, "input"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ({"input": "x", "bogus": 1}, "bogus"),
            ({"input": [10**9]}, "input"),
            ({"input": "word " * 2100}, "input"),  # longer than the demo's 2048-token context
        ]:
            assert_error(http.post("/v1/embeddings", json=body), 400, param=param)
        refused = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert_error(refused, 400, code="unsupported_runner")
    with server.http() as http:
        assert_error(
            http.post("/v1/embeddings", json={"input": "x"}), 400, code="unsupported_runner"
        )
        assert_error(http.post("/rerank", json={"query": "q", "documents": ["d"]}), 400)
    assert_error(httpx.post(f"{pool_server.base_url}/v1/embeddings", json={"input": "x"}), 401)


def test_a_route_applies_to_embeddings(
    demo_cache: str, server_log_dir: Path, tmp_path: Path
) -> None:
    """Route defaults for sampling do not break a pooling body; the route's limits still hold."""
    routes = tmp_path / "routes.yaml"
    routes.write_text(
        "routes:\n  - name: embed\n    match: {models: [demo]}\n    max_input_tokens: 8\n"
        "    defaults: {temperature: 0.5, max_tokens: 4}\n"
    )
    handle = start_server(server_log_dir, "--runner", "pooling", "--routes-config", str(routes))
    try:
        with handle.http() as http:
            ok = http.post("/v1/embeddings", json={"input": "short"})
            assert ok.status_code == 200, ok.text
            long = http.post("/v1/embeddings", json={"input": "a much longer input " * 8})
            assert_error(long, 400, code="context_length_exceeded")
    finally:
        handle.stop()


def test_ping_invocations_and_load(pool_server: ServerHandle, server: ServerHandle) -> None:
    with pool_server.http() as http:
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        assert (
            http.post("/invocations", json={"input": "x"}).json()["data"][0]["object"]
            == "embedding"
        )
        ranked = http.post("/invocations", json={"query": "q", "documents": ["d"]}).json()
        assert "results" in ranked
        assert_error(http.post("/invocations", json={"prompt": "x"}), 400)
    with server.http() as http:
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        assert http.post("/invocations", json=chat).json()["object"] == "chat.completion"
        text = http.post("/invocations", json={"prompt": "x", "max_tokens": 2}).json()
        assert text["object"] == "text_completion"
        assert isinstance(http.get("/load").json()["server_load"], int)  # counted: test_api_streams
    assert httpx.get(f"{server.base_url}/load").status_code == 401
