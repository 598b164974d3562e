"""engine/request_limits.py: every bound on a request, and the offline API that applies them.

The rule is vLLM's: a ``max_tokens`` that does not fit the context after the prompt is
refused where the caller asks for that (the API servers), and the output stops at the
context's end otherwise (the offline ``LLM``); without ``max_tokens`` a request may use the
whole context its prompt leaves. Over HTTP: tests/entrypoints/test_request_limits_http.py.
"""

from __future__ import annotations

import pytest

from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine import request_limits
from tokenmill.engine.request_limits import InputLimits, RequestCaps, RouteCaps
from tokenmill.entrypoints.llm import LLM
from tokenmill.errors import ContextLengthError, FeatureNotAllowedError, RequestLimitError

LIMITS = InputLimits(
    vocab_size=1000,
    max_model_len=64,
    kv_capacity_tokens=4096,
    max_logprobs=20,
    scheduling_policy="fcfs",
    eos_token_ids=frozenset({2}),
    enable_prefix_caching=True,
    supports_beam_search=True,
    max_num_seqs=8,
)
API = RequestCaps(max_tokens_must_fit=True)
ROUTE = RouteCaps(name="chat", max_model_len=48, max_input_tokens=40, max_tokens=10, max_n=2)


def _resolved(num_prompt: int, caps: RequestCaps = API, **params: object) -> int | None:
    return request_limits.resolve(num_prompt, SamplingParams(**params), LIMITS, caps).max_tokens  # type: ignore[arg-type]


# ---- the context and max_tokens --------------------------------------------------------------
def test_a_prompt_must_leave_room_for_output() -> None:
    request_limits.check_prompt(63, LIMITS)
    with pytest.raises(ContextLengthError, match="maximum context length is 64 tokens") as info:
        request_limits.check_prompt(64, LIMITS)
    assert (info.value.param, info.value.limit, info.value.value) == ("prompt", "context", 64)


def test_a_pooling_prompt_may_fill_the_context() -> None:
    request_limits.check_prompt(64, LIMITS, is_pooling=True)
    with pytest.raises(ContextLengthError) as info:
        request_limits.check_prompt(65, LIMITS, is_pooling=True)
    assert info.value.param == "input"


def test_max_tokens_that_does_not_fit_is_refused_where_it_must_fit() -> None:
    assert _resolved(54, max_tokens=10) == 10  # 54 + 10 == 64: fits
    with pytest.raises(ContextLengthError) as info:
        _resolved(55, max_tokens=10)
    error = info.value
    assert (error.param, error.limit, error.value, error.bound) == ("max_tokens", "context", 10, 9)
    assert error.message.startswith("'max_tokens' or 'max_completion_tokens' is too large: 10.")
    assert "(10 > 64 - 55)" in error.message


def test_the_error_names_the_field_the_request_used() -> None:
    caps = RequestCaps(max_tokens_must_fit=True, max_tokens_param="max_completion_tokens")
    with pytest.raises(ContextLengthError) as info:
        _resolved(60, caps, max_tokens=10)
    assert info.value.param == "max_completion_tokens"


def test_offline_max_tokens_stops_at_the_context() -> None:
    assert _resolved(55, request_limits.OFFLINE, max_tokens=10) == 9


def test_no_max_tokens_takes_what_the_prompt_leaves() -> None:
    assert _resolved(50, max_tokens=None) == 14
    assert _resolved(50, request_limits.OFFLINE, max_tokens=None) == 14


def test_min_tokens_stays_under_the_resolved_max_tokens() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=8)
    resolved = request_limits.resolve(60, params, LIMITS)
    assert (resolved.max_tokens, resolved.min_tokens) == (4, 4)
    fits = SamplingParams(max_tokens=4, min_tokens=2)
    assert request_limits.resolve(10, fits, LIMITS) is fits


def test_the_generation_config_cap_applies_without_refusing() -> None:
    """vLLM takes the smallest of the request's, the context left and ``max_new_tokens``."""
    caps = RequestCaps(default_max_tokens=6, max_tokens_must_fit=True)
    assert _resolved(10, caps, max_tokens=None) == 6
    assert _resolved(10, caps, max_tokens=30) == 6
    assert _resolved(10, caps, max_tokens=3) == 3
    assert _resolved(60, caps, max_tokens=None) == 4
    with pytest.raises(ContextLengthError):  # the request's own value must still fit
        _resolved(60, caps, max_tokens=30)


def test_the_kv_cache_capacity_bounds_the_context_when_smaller() -> None:
    small_kv = InputLimits(**{**LIMITS.__dict__, "kv_capacity_tokens": 32})
    assert small_kv.max_total_tokens == 32
    with pytest.raises(ContextLengthError, match="KV cache holds at most 32 tokens"):
        request_limits.check_prompt(32, small_kv)
    assert request_limits.resolve(20, SamplingParams(max_tokens=None), small_kv).max_tokens == 12


# ---- a route's caps --------------------------------------------------------------------------
def test_a_routes_context_is_refused_past_and_bounds_the_default() -> None:
    caps = RequestCaps(route=ROUTE, max_tokens_must_fit=True)
    with pytest.raises(ContextLengthError, match="route 'chat' has a context of 48 tokens"):
        _resolved(40, caps, max_tokens=9)
    assert _resolved(40, caps, max_tokens=8) == 8
    # No max_tokens: the route's cap, within what the prompt leaves of its context.
    assert _resolved(40, caps, max_tokens=None) == 8
    assert _resolved(10, caps, max_tokens=None) == 10


def test_a_routes_prompt_and_max_tokens_caps() -> None:
    caps = RequestCaps(route=ROUTE, max_tokens_must_fit=True)
    with pytest.raises(ContextLengthError, match="at most 40 tokens; this one has 41") as info:
        request_limits.check_prompt(41, LIMITS, caps)
    assert (info.value.param, info.value.limit) == ("prompt", "max_input_tokens")
    with pytest.raises(RequestLimitError, match="at most 10 output tokens") as cap:
        request_limits.check_params(SamplingParams(max_tokens=11), LIMITS, caps)
    assert (cap.value.param, cap.value.limit, cap.value.bound) == (
        "max_tokens",
        "route_max_tokens",
        10,
    )
    assert not isinstance(cap.value, FeatureNotAllowedError)


def test_a_routes_features_and_max_n() -> None:
    route = RouteCaps(name="lean", max_n=1, allow_logprobs=False, allow_beam_search=False)
    caps = RequestCaps(route=route)
    for params, param in (
        (SamplingParams(n=2), "n"),
        (SamplingParams(logprobs=0), "logprobs"),
        (SamplingParams(prompt_logprobs=1), "prompt_logprobs"),
        (SamplingParams(use_beam_search=True, temperature=0.0), "use_beam_search"),
    ):
        with pytest.raises(FeatureNotAllowedError, match="route 'lean' does not allow") as info:
            request_limits.check_params(params, LIMITS, caps)
        assert info.value.param == param
    request_limits.check_params(SamplingParams(n=1), LIMITS, caps)


# ---- n, beam width, logprobs -----------------------------------------------------------------
def test_logprobs_counts_are_bounded() -> None:
    request_limits.check_params(SamplingParams(logprobs=20, prompt_logprobs=20), LIMITS)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestLimitError, match=f"{name} must be at most 20") as info:
            request_limits.check_params(SamplingParams(**{name: 21}), LIMITS)  # type: ignore[arg-type]
        assert (info.value.param, info.value.limit, info.value.value) == (name, "max_logprobs", 21)


def test_the_beam_width_is_bounded_by_max_num_seqs_and_the_vocabulary() -> None:
    beam = {"use_beam_search": True, "temperature": 0.0}
    request_limits.check_params(SamplingParams(n=8, **beam), LIMITS)  # type: ignore[arg-type]
    with pytest.raises(RequestLimitError, match="must not exceed --max-num-seqs") as info:
        request_limits.check_params(SamplingParams(n=2, best_of=9, **beam), LIMITS)  # type: ignore[arg-type]
    assert (info.value.param, info.value.limit, info.value.value) == ("best_of", "beam_width", 9)
    tiny_vocab = InputLimits(**{**LIMITS.__dict__, "vocab_size": 10})
    with pytest.raises(RequestLimitError, match="too large for the vocabulary") as vocab:
        request_limits.check_params(SamplingParams(n=6, **beam), tiny_vocab)  # type: ignore[arg-type]
    assert vocab.value.param == "n"


# ---- the offline API -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(make_model) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(make_model("llama")), dtype="float32", max_model_len=32, max_num_seqs=4)


def test_offline_max_tokens_none_and_beyond_the_context_stop_at_its_end(llm: LLM) -> None:
    for max_tokens in (None, 1000):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([[5] * 28], params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length", max_tokens


def test_offline_beam_search_stops_at_the_context(llm: LLM) -> None:
    params = SamplingParams(
        use_beam_search=True, n=2, temperature=0.0, max_tokens=1000, ignore_eos=True
    )
    out = llm.generate([[5] * 28], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]


def test_offline_bounds_raise_typed_errors(llm: LLM) -> None:
    with pytest.raises(ContextLengthError) as context:
        llm.generate([[5] * 32], SamplingParams(max_tokens=1), use_tqdm=False)
    assert (context.value.limit, context.value.bound) == ("context", 31)
    with pytest.raises(RequestLimitError) as width:
        llm.generate(["hi"], SamplingParams(use_beam_search=True, n=5, temperature=0.0))
    assert (width.value.limit, width.value.bound) == ("beam_width", 4)
    assert not llm.engine.has_unfinished_requests()
