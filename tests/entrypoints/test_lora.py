"""LoRA serving: adapters by name, listed with their parent, loaded and unloaded at run time
under concurrent traffic, bad adapters refused with nothing changed, per-adapter metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.entrypoints.conftest import ServerHandle, assert_error, start_server
from tests.entrypoints.inprocess import WAIT_S

PROMPT = [5, 300, 41, 977, 12, 64, 1500, 8, 230, 31, 700, 9, 1200, 77, 18, 402, 5, 66]
MAX_TOKENS = 8
LONG_TOKENS = 48


@pytest.fixture(scope="module")
def demo_folder(demo_cache: str) -> Path:
    from tokenmill.model.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="module")
def adapters(make_adapter, demo_folder: Path) -> dict[str, Path]:
    return {
        "a1": make_adapter(demo_folder, seed=21),
        "a2": make_adapter(demo_folder, seed=22, r=4, target_modules=["q_proj", "v_proj"]),
        "a2-new": make_adapter(demo_folder, seed=23, target_modules=["gate_proj", "down_proj"]),
        "a3": make_adapter(demo_folder, seed=24, use_rslora=True),
    }


class Reference:
    """Checks that tokens are the greedy continuation of PROMPT under transformers (+ peft),
    with one teacher-forced forward each: much cheaper than ``generate`` on a busy machine."""

    def __init__(self, demo_folder: Path, adapters: dict[str, Path]) -> None:
        self.demo_folder = demo_folder
        self.adapters = adapters
        self._models: dict[str, torch.nn.Module] = {}
        self.seen: dict[str, set[tuple[int, ...]]] = {}
        """Per adapter (or "demo"): every distinct answer checked."""

    def _model(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            import peft
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(
                self.demo_folder, dtype=torch.float32
            )
            if name != "demo":
                model = peft.PeftModel.from_pretrained(model, self.adapters[name])
            self._models[name] = model.eval()
        return self._models[name]

    def check(self, name: str, tokens: list[int] | int) -> None:
        """``tokens`` is what greedy decoding of PROMPT gives on ``name``."""
        assert isinstance(tokens, list), (name, tokens)
        if tuple(tokens) in self.seen.get(name, ()):
            return
        with torch.no_grad():
            logits = self._model(name)(torch.tensor([PROMPT + tokens])).logits[0]
        greedy = logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()
        assert greedy == tokens, (name, tokens, greedy)
        self.seen.setdefault(name, set()).add(tuple(tokens))


@pytest.fixture(scope="module")
def reference(demo_folder: Path, adapters: dict[str, Path]) -> Reference:
    return Reference(demo_folder, adapters)


@pytest.fixture(scope="module")
def lora_server(server_log_dir: Path, adapters: dict[str, Path]):
    handle = start_server(
        server_log_dir,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--max-model-len",
        "256",
        "--allow-runtime-lora-updating",
        "--lora-modules",
        f"a1={adapters['a1']}",
        json.dumps({"name": "a2", "path": str(adapters["a2"]), "base_model_name": "demo-base"}),
    )
    yield handle
    handle.stop()
    assert "Traceback" not in handle.log(), handle.log()


def _tokens(http: httpx.Client, model: str, max_tokens: int = MAX_TOKENS) -> list[int] | int:
    """Greedy token ids the server generates for PROMPT on ``model``, or the error status."""
    r = http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    if r.status_code != 200:
        return r.status_code
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _model_ids(http: httpx.Client) -> dict[str, dict]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def _labelled(server: ServerHandle, name: str) -> dict[str, float]:
    """``lora_name -> value`` of one per-adapter counter."""
    text = httpx.get(f"{server.base_url}/metrics", headers=server.headers(), timeout=10).text
    out = {}
    for line in text.splitlines():
        match = re.match(rf"^tokenmill:{name}_total\{{(.*)\}} (\S+)$", line)
        if match:
            out[re.search(r'lora_name="([^"]*)"', match.group(1)).group(1)] = float(match.group(2))
    return out


def test_adapters_are_listed_with_their_parent_and_selected_by_model(
    lora_server: ServerHandle, reference: Reference
) -> None:
    with lora_server.http() as http:
        cards = _model_ids(http)
        assert list(cards) == ["demo", "a1", "a2"]
        assert cards["a1"]["parent"] == "demo" and cards["a2"]["parent"] == "demo-base"
        assert cards["demo"]["parent"] is None
        assert http.get("/v1/models/a1").json()["id"] == "a1"
        answers = {model: _tokens(http, model) for model in ("demo", "a1", "a2")}
        for model, tokens in answers.items():
            reference.check(model, tokens)
        assert len({str(t) for t in answers.values()}) == 3, "the adapters must change the output"
        assert _tokens(http, "a1") == answers["a1"]
        chat = http.post(
            "/v1/chat/completions",
            json={"model": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200 and chat.json()["model"] == "a2", chat.text
        assert_error(
            http.post("/v1/completions", json={"model": "a9", "prompt": "x", "max_tokens": 1}),
            404,
            param="model",
            code="model_not_found",
        )
    line = re.compile(r'"POST /v1/completions" 200 .* lora=a2$')
    deadline = time.monotonic() + WAIT_S
    while not any(line.search(t) for t in lora_server.log().splitlines()):
        assert time.monotonic() < deadline, lora_server.log()
        time.sleep(0.05)


def _nan_copy(adapter: Path, dest: Path) -> Path:
    """A copy of an adapter with one NaN in one lora_B."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, dest)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    name = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest


def test_bad_adapters_are_refused_and_change_nothing(
    tmp_path: Path, lora_server: ServerHandle, make_adapter, make_model, demo_folder: Path
) -> None:
    good = make_adapter(demo_folder, seed=21)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    cases = {
        str(tmp_path / "missing"): "not a readable PEFT LoRA adapter folder",
        str(no_weights): "not a readable PEFT LoRA adapter folder",
        str(_nan_copy(good, tmp_path / "nan")): "NaN or infinite values",
        str(make_adapter(demo_folder, seed=31, r=16)): "above --max-lora-rank 8",
        str(make_adapter(demo_folder, seed=32, target_modules=["q_proj", "lm_head"])): "lm_head",
        str(make_adapter(make_model("llama"), seed=33)): "another base model",
    }
    with lora_server.http() as http:
        before = _model_ids(http)
        for path, message in cases.items():
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
            error = assert_error(r, 400, param="lora_path")
            assert message in error["message"], error
        assert_error(
            http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(good)}),
            400,
            param="lora_name",
        )
        assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
        for name in ("../x", "/abs", "a/b", "..", "demo", " "):  # paths, the base model, empty
            r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(good)})
            assert_error(r, 400, param="lora_name")
        # Whether a path exists, is a file or a folder that is no adapter: the same answer.
        a_file = tmp_path / "a-file"
        a_file.write_text("x")
        messages = set()
        for path in (tmp_path / "missing", a_file, tmp_path, demo_folder):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": str(path)})
            error = assert_error(r, 400, param="lora_path")
            messages.add(error["message"].replace(str(path), "<path>"))
        assert len(messages) == 1, messages
        assert_error(
            http.post("/v1/unload_lora_adapter", json={"lora_name": "bad"}),
            404,
            code="model_not_found",
        )
        assert _model_ids(http) == before
        assert _tokens(http, "bad") == 404
    unauthenticated = httpx.post(
        f"{lora_server.base_url}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(good)},
    )
    assert_error(unauthenticated, 401)


def test_load_use_unload_reload_under_concurrent_traffic(
    lora_server: ServerHandle, adapters: dict[str, Path], reference: Reference
) -> None:
    """Every answer is its own adapter's; an unloaded adapter's in-flight request finishes
    with it; the KV cache ends empty; per-adapter counts add up."""
    served: Counter[str] = Counter()
    before = _labelled(lora_server, "lora_requests")
    stop = threading.Event()
    answers: list[tuple[str, list[int] | int]] = []
    """(adapter, tokens), checked against the reference at the end (off the hot path)."""

    def traffic(models: list[str], renamed: dict[str, str] | None = None) -> None:
        with lora_server.http() as http:
            i = 0
            while not stop.is_set():
                model = models[i % len(models)]
                answers.append(((renamed or {}).get(model, model), _tokens(http, model)))
                served[model] += 1
                i += 1

    with lora_server.http() as http, ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(traffic, ["demo", "a1"]), pool.submit(traffic, ["a1", "demo"])]
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"])}
        )
        assert r.status_code == 200, r.text
        answers.append(("a3", _tokens(http, "a3")))
        served["a3"] += 1
        # unload a2 while a long request on it runs: that request finishes with a2
        in_flight = pool.submit(_tokens, lora_server.http(), "a2", LONG_TOKENS)
        deadline = time.monotonic() + WAIT_S
        while lora_server.metrics()["tokenmill:num_requests_running"] < 1 and not in_flight.done():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200, r.text
        assert _tokens(http, "a2") == 404
        assert "a2" not in _model_ids(http)
        # the same name again, other weights: a new adapter (no KV or weights shared)
        r = http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(adapters["a2-new"])}
        )
        assert r.status_code == 200, r.text
        answers.append(("a2-new", _tokens(http, "a2")))
        answers.append(("a2", in_flight.result()))  # unloaded while it ran: still the old a2
        served["a2"] += 2
        workers.append(pool.submit(traffic, ["a2", "a3", "demo"], {"a2": "a2-new"}))
        time.sleep(1.0)
        stop.set()
        for worker in workers:
            worker.result()
    for name, tokens in answers:
        reference.check(name, tokens)
    # greedy: each adapter always answers the same, and no two adapters answer alike
    firsts = {name: {seq[:MAX_TOKENS] for seq in seqs} for name, seqs in reference.seen.items()}
    assert all(len(f) == 1 for f in firsts.values()), firsts
    assert len({f.pop() for f in firsts.values()}) == len(firsts), reference.seen
    metrics = lora_server.wait_idle()
    assert metrics["tokenmill:kv_cache_usage_perc"] == 0
    counted = _labelled(lora_server, "lora_requests")
    for name in ("a1", "a2", "a3"):
        assert counted.get(name, 0) - before.get(name, 0) == served[name], (name, counted, served)
    tokens = _labelled(lora_server, "lora_generation_tokens")
    assert tokens["a3"] == served["a3"] * MAX_TOKENS


def test_lora_module_flags_are_parsed_and_checked() -> None:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.entrypoints.openai.lora import LoRAModule, parse_lora_module
    from tokenmill.entrypoints.openai.server import build_app
    from tokenmill.entrypoints.openai.state import ServerConfig
    from tokenmill.errors import ConfigError

    assert parse_lora_module("sql=/a/b") == LoRAModule("sql", "/a/b")
    assert parse_lora_module('{"name": "c", "path": "/p", "base_model_name": "m"}') == LoRAModule(
        "c", "/p", "m"
    )
    for bad in ("nopath", "=x", '{"name": "c"}', '{"name": "c", "path": "/p", "x": 1}', "{"):
        with pytest.raises(ConfigError, match="--lora-modules"):
            parse_lora_module(bad)
    with pytest.raises(ConfigError, match="appears twice"):
        ServerConfig(lora_modules=("a=/x", "a=/y"))
    engine_config = EngineConfig()
    with pytest.raises(ConfigError, match="--enable-lora"):
        build_app(
            AsyncLLMEngine(engine_config), ServerConfig(lora_modules=("a=/x",)), engine_config
        )
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
