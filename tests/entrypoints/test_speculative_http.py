"""Speculative decoding behind the server: ``--speculative-config`` as vLLM takes it, the
same greedy text as without it, vLLM's counters on /metrics, and beam search refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.entrypoints.conftest import ServerHandle, assert_error, start_server
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM

PROMPT = (
    "Rewrite this text: The river ran quietly through the valley, past fields of wheat and "
    "rows of apple trees.\nRewritten: The river ran quietly"
)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


@pytest.fixture(scope="module")
def spec_server(demo_cache: str, server_log_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(
        server_log_dir,
        "--max-model-len",
        "256",
        "--speculative-config",
        json.dumps(SPEC),
        api_key=None,
    )
    yield handle
    handle.stop()


def test_greedy_text_is_unchanged_and_counted(spec_server: ServerHandle) -> None:
    client = spec_server.openai()
    before = spec_server.metrics()
    got = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    want = LLM("demo", max_model_len=256, dtype="float32").generate(  # as start_server pins it
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    assert got.choices[0].text == want[0].outputs[0].text
    assert got.usage.completion_tokens == 40
    after = spec_server.wait_idle()
    drafted = "tokenmill:spec_decode_num_draft_tokens_total"
    accepted = "tokenmill:spec_decode_num_accepted_tokens_total"
    assert after[drafted] > before.get(drafted, 0)
    assert after[accepted] > before.get(accepted, 0)
    assert "tokenmill:spec_decode_num_drafts_total" in after
    assert after["tokenmill:spec_decode_policy_steps_total"] > 0  # the policy, measured
    assert "speculative decoding: ngram, 4 tokens per step" in spec_server.log()


def test_beam_search_is_a_400(spec_server: ServerHandle) -> None:
    with spec_server.http() as http:
        response = http.post(
            "/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True},
        )
    error = assert_error(response, 400, param="use_beam_search")
    assert "speculative" in error["message"]
    with pytest.raises(openai.BadRequestError):
        spec_server.openai().completions.create(
            model="demo", prompt="Hi", max_tokens=3, n=2, extra_body={"use_beam_search": True}
        )


def test_a_bad_speculative_config_stops_the_start(server_log_dir: Path) -> None:
    handle = start_server(
        server_log_dir, "--speculative-config", '{"method": "medusa"}', api_key=None, wait=False
    )
    assert handle.process.wait(timeout=600) == 2  # a usage error, as argparse gives
    assert "--speculative-config: method 'medusa' is not supported" in handle.log()
