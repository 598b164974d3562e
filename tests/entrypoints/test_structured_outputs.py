"""Structured outputs and tool calls through a real server, with the official openai client.

One server with ``--enable-auto-tool-choice --tool-call-parser hermes``. Generated JSON
schemas run concurrently (greedy and sampled, streamed and not, n=2) and every completion
must validate; bad constraints are 400s while another request keeps streaming.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.conftest import ServerHandle, assert_error, sse_events, start_server
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.structured_params import StructuredOutputsParams
from tokenmill.entrypoints.openai.generation_request import compile_grammar
from tokenmill.errors import InvalidRequestError

MESSAGES = [{"role": "user", "content": "Describe a file as JSON."}]
NUM_SCHEMAS = 200


@pytest.fixture(scope="module")
def so_server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        server_log_dir,
        "--max-num-seqs",
        "16",
        "--max-model-len",
        "1024",
        "--max-request-body-bytes",
        "4MiB",
        "--grammar-compile-timeout",
        "1",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    yield handle
    handle.stop()
    assert "Traceback" not in handle.log(), handle.log()


@pytest.fixture
def oai(so_server: ServerHandle) -> openai.OpenAI:
    return so_server.openai().with_options(timeout=180)


# ---- generated schemas ------------------------------------------------------------------------
def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "pattern", "integer", "number", "boolean", "enum", "null"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]$"])}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, None, True], k=rng.randint(1, 3))}
    return {"type": kind}


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return {"type": "array", "items": _schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if depth < 2 and roll < 0.35:
        return {"anyOf": [_leaf(rng), _schema(rng, depth + 1)]}
    if depth < 2 and roll < 0.75:
        names = rng.sample(
            ["id", "name", "size", "tags", "meta", "ok", "kind"], k=rng.randint(1, 4)
        )
        properties = {n: _schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.7]
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }
    return _leaf(rng)


def _object_schema(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    schema = _schema(rng)
    if schema.get("type") != "object":
        schema = {"type": "object", "properties": {"value": schema}, "required": ["value"]}
        schema["additionalProperties"] = False
    return schema


def _run_schema(oai: openai.OpenAI, seed: int) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of each choice for schema ``seed``, in a mode the seed picks."""
    schema = _object_schema(seed)
    kwargs: dict[str, Any] = {
        "model": "demo",
        "messages": MESSAGES,
        "max_tokens": 400,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": f"s{seed}", "schema": schema, "strict": True},
        },
        "temperature": 0.0 if seed % 2 == 0 else 1.0,
        "seed": seed,
        "n": 2 if seed % 3 == 0 else 1,
    }
    if seed % 4 < 2:
        result = oai.chat.completions.create(**kwargs)
        return [(c.message.content or "", c.finish_reason) for c in result.choices]
    texts = [""] * kwargs["n"]
    reasons: list[str | None] = [None] * kwargs["n"]
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return list(zip(texts, reasons, strict=True))


def test_generated_schemas_always_validate(oai: openai.OpenAI) -> None:
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda s: _run_schema(oai, s), range(NUM_SCHEMAS)))
    for seed, choices in enumerate(results):
        for text, reason in choices:
            assert reason == "stop", (seed, text)
            jsonschema.validate(json.loads(text), _object_schema(seed))


class Shelf(BaseModel):
    label: str = Field(max_length=8)
    colour: Literal["red", "green"]
    count: int = Field(ge=0, le=99)
    heights: list[int] = Field(max_length=2)


def test_beta_parse_with_a_pydantic_model(oai: openai.OpenAI) -> None:
    result = oai.beta.chat.completions.parse(
        model="demo", messages=MESSAGES, response_format=Shelf, max_tokens=200, temperature=0
    )
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Shelf)
    assert 0 <= parsed.count <= 99 and len(parsed.label) <= 8


def _object_or_its_start(text: str) -> bool:
    """json_object bounds nothing, so 40 tokens may end inside a string: then a prefix."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return text.startswith('{"')


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
        ({"structured_outputs": {"regex": "(ab|cd)+"}}, lambda t: re.fullmatch("(ab|cd)+", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"guided_grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, lambda t: t in ("yes", "no")),
        ({"response_format": {"type": "json_object"}}, lambda t: _object_or_its_start(t)),
        (
            {"structured_outputs": {"json": {"type": "integer", "minimum": 3, "maximum": 9}}},
            lambda t: 3 <= json.loads(t) <= 9,
        ),
    ],
)
def test_regex_choice_grammar_and_json_object(
    oai: openai.OpenAI, extra: dict[str, Any], check: Any
) -> None:
    chat = oai.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=40, temperature=0.7, seed=3, extra_body=extra
    )
    completion = oai.completions.create(
        model="demo", prompt="Answer:", max_tokens=40, temperature=0, extra_body=extra
    )
    for text in (chat.choices[0].message.content or "", completion.choices[0].text):
        assert check(text), text


def test_unconstrained_requests_keep_their_greedy_tokens_beside_constrained_ones(
    oai: openai.OpenAI,
) -> None:
    def plain() -> str:
        return (
            oai.completions.create(model="demo", prompt="The licence", max_tokens=24, temperature=0)
            .choices[0]
            .text
        )

    def constrained(seed: int) -> str:
        return (
            oai.completions.create(
                model="demo",
                prompt="Data:",
                max_tokens=60,
                temperature=1.0,
                seed=seed,
                extra_body={"guided_json": _object_schema(seed)},
            )
            .choices[0]
            .text
        )

    alone = plain()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(constrained, s) for s in range(6)]
        beside = [pool.submit(plain) for _ in range(2)]
        assert [f.result() for f in beside] == [alone, alone]
        for f in futures:
            f.result()


# ---- tools ------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _streamed_calls(oai: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, str]], str | None]:
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
                if t.function and t.function.name:
                    entry["name"] = t.function.name
                if t.function and t.function.arguments:
                    entry["arguments"] += t.function.arguments
            reason = c.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_validate_and_stream_the_same(
    oai: openai.OpenAI, tool_choice: Any
) -> None:
    kwargs: dict[str, Any] = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 0,
    }
    result = oai.chat.completions.create(**kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    streamed, reason = _streamed_calls(oai, **kwargs)
    assert reason == "tool_calls"
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_call_cut_off_by_max_tokens_is_never_returned(
    oai: openai.OpenAI, tool_choice: Any
) -> None:
    """max_tokens ends the forced call mid-arguments: the answer has finish_reason
    "length" and no tool call, whole or streamed, rather than arguments that do not parse."""
    kwargs: dict[str, Any] = {
        "model": "demo", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
        "max_tokens": 6, "temperature": 0,
    }  # fmt: skip
    choice = oai.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    streamed, reason = _streamed_calls(oai, **kwargs)
    assert reason == "length" and streamed == []


def test_auto_tool_choice_answers_with_content_or_valid_calls(oai: openai.OpenAI) -> None:
    result = oai.chat.completions.create(
        model="demo", messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0
    )
    choice = result.choices[0]
    for call in choice.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_multi_turn_with_tool_results_renders_and_continues(oai: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Add one."}]
    first = oai.chat.completions.create(
        model="demo", messages=messages, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0,
    )  # fmt: skip
    call = (first.choices[0].message.tool_calls or [])[0]
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "2"})
    second = oai.chat.completions.create(
        model="demo", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert second.choices[0].message.content is not None
    assert not second.choices[0].message.tool_calls
    third = oai.chat.completions.create(
        model="demo", messages=messages, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60, temperature=0,
    )  # fmt: skip
    assert third.usage.prompt_tokens > first.usage.prompt_tokens  # the history was rendered


def test_auto_without_the_flag_and_bad_tool_requests_are_400s(
    server: ServerHandle, so_server: ServerHandle
) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    with server.http() as http:
        error = assert_error(http.post("/v1/chat/completions", json=body), 400, "tool_choice")
        assert "--enable-auto-tool-choice" in error["message"]
    with so_server.http() as http:
        for extra, param in [
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
            (
                {"tools": [{"type": "function", "function": {"name": "a b"}}]},
                "tools.0.function.name",
            ),
        ]:
            assert_error(http.post("/v1/chat/completions", json={**body, **extra}), 400, param)


# ---- bad constraints ---------------------------------------------------------------------------
HUGE_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "x" * 1000} for i in range(1000)},
}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"guided_json": {"type": "nope"}}, "guided_json", "Invalid type"),
        ({"guided_json": '{"type": "object",'}, "guided_json", "invalid JSON schema"),
        ({"structured_outputs": {"json": {"not": {"type": "string"}}}}, "structured_outputs", "Unimplemented keys"),
        ({"guided_json": HUGE_SCHEMA}, "guided_json", "at most"),
        ({"guided_grammar": "start: /[^\\s\\S]/"}, "guided_grammar", "no output can satisfy it"),
        ({"guided_json": {"type": "integer", "minimum": 2, "maximum": 1}}, "guided_json", "Unsatisfiable"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_while_the_server_keeps_serving(
    so_server: ServerHandle, extra: dict[str, Any], param: str, message: str
) -> None:
    with so_server.http(timeout_s=60) as http:
        body = {"prompt": "The", "max_tokens": 48, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as stream:
            bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
            error = assert_error(bad, 400, param)
            assert message in error["message"], error
            events = sse_events(stream)
        assert events[-1] == "[DONE]"
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
        assert finishes[-1] == "length"


def test_an_expensive_regex_never_stalls_other_requests(so_server: ServerHandle) -> None:
    # Its lexer takes about a second to build (more on a loaded machine): on the grammar
    # pool, answered 400 past --grammar-compile-timeout (1 s here), never in an engine step.
    with so_server.http(timeout_s=60) as http:
        body = {"prompt": "The", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            r = http.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 4, "guided_regex": "(a{1000}){1000}{1000}"},
            )
            if r.status_code != 200:
                error = assert_error(r, 400, "guided_regex")
                assert "longer than 1s" in error["message"], error
            else:
                assert set(r.json()["choices"][0]["text"]) <= {"a"}
            events = sse_events(stream)
        assert events[-1] == "[DONE]"


def test_compile_time_budget_is_a_400_naming_the_field() -> None:
    release = threading.Event()

    def slow_compile(params: SamplingParams) -> None:
        release.wait(30)

    state = SimpleNamespace(
        engine=SimpleNamespace(compile_grammar=slow_compile, cached_grammar=lambda c: None),
        config=SimpleNamespace(grammar_compile_timeout_s=0.05),
        grammar_pool=ThreadPoolExecutor(1),
    )
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    try:
        with pytest.raises(InvalidRequestError, match=r"longer than 0\.05s") as info:
            asyncio.run(compile_grammar(state, params, "guided_regex"))  # type: ignore[arg-type]
        assert info.value.param == "guided_regex"
    finally:
        release.set()
        state.grammar_pool.shutdown()


def test_the_compile_budget_starts_when_the_compile_does() -> None:
    """With one compile at a time, a request queued behind a slow compile is not refused for
    the time it waited; one that leaves while queued never compiles."""
    ran: list[str] = []

    def compile_(params: SamplingParams) -> None:
        ran.append(params.structured_outputs.regex)  # type: ignore[union-attr]
        time.sleep(0.3)

    state = SimpleNamespace(
        engine=SimpleNamespace(compile_grammar=compile_, cached_grammar=lambda c: None),
        config=SimpleNamespace(grammar_compile_timeout_s=0.5),
        grammar_pool=ThreadPoolExecutor(1),
    )

    def params(regex: str) -> SamplingParams:
        return SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))

    async def main() -> None:
        first = asyncio.ensure_future(compile_grammar(state, params("a"), "f"))  # type: ignore[arg-type]
        second = asyncio.ensure_future(compile_grammar(state, params("b"), "f"))  # type: ignore[arg-type]
        third = asyncio.ensure_future(compile_grammar(state, params("c"), "f"))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        third.cancel()  # left while queued behind two 0.3 s compiles
        await asyncio.gather(first, second)  # the second waited 0.3 s, past no budget
        await asyncio.sleep(0.4)

    try:
        asyncio.run(main())
    finally:
        state.grammar_pool.shutdown()
    assert ran == ["a", "b"]


@pytest.mark.parametrize("bound", [1, 3])
def test_at_most_the_configured_number_of_compiles_run_at_once(bound: int) -> None:
    """llguidance holds the GIL while compiling: concurrent compiles stall every stream."""
    from tokenmill.entrypoints.openai.state import ServerConfig, ServerState

    lock = threading.Lock()
    running, peak = [0], [0]

    def compile_(params: SamplingParams) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    engine = SimpleNamespace(compile_grammar=compile_, cached_grammar=lambda c: None)
    state = ServerState(
        ServerConfig(max_concurrent_grammar_compiles=bound),
        None,  # type: ignore[arg-type]
        engine,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
    )

    async def main() -> None:
        await asyncio.gather(
            *(
                compile_grammar(
                    state,
                    SamplingParams(structured_outputs=StructuredOutputsParams(regex=f"a{i}")),
                    "f",
                )
                for i in range(8)
            )
        )

    try:
        asyncio.run(main())
    finally:
        state.grammar_pool.shutdown()
    assert peak[0] == bound


def test_compile_threads_run_at_the_lowest_cpu_priority() -> None:
    """A compile is seconds of CPU: on a small machine the engine's step must win it."""
    import os

    from tokenmill.entrypoints.openai.state import GRAMMAR_THREAD_NICE, new_grammar_pool

    pool = new_grammar_pool(1)
    try:
        nice = pool.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ).result(30)
    finally:
        pool.shutdown()
    assert nice == GRAMMAR_THREAD_NICE == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # this thread's kept


def test_catastrophic_backtracking_regexes_are_served_without_backtracking(
    oai: openai.OpenAI,
) -> None:
    # Nested quantifiers that make a backtracking engine exponential: llguidance matches
    # with derivatives, so these compile in milliseconds and constrain as written.
    for regex in ["(a|aa){1,10}b", "(x{1,3}){1,5}y", "((ab|a)(b|ba)?){1,4}c"]:
        choice = oai.completions.create(
            model="demo", prompt="Pattern:", max_tokens=40, temperature=0,
            extra_body={"guided_regex": regex},
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "stop" and re.fullmatch(regex, choice.text), choice


def test_streamed_json_concatenates_to_the_non_streamed_text(so_server: ServerHandle) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 200,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "shelf", "schema": Shelf.model_json_schema()},
        },
    }
    with so_server.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)
    text = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in events[:-1]
        if isinstance(e, dict) and e["choices"]
    )
    assert text == whole["message"]["content"]
    Shelf.model_validate_json(text)
