"""Speculative decoding's torch-free half: config, n-gram proposals, the batch-size policy,
and the scheduler/KV bookkeeping of draft tokens (rollback of rejected ones)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.kv.test_paged import check_invariants
from tokenmill.config import EngineConfig
from tokenmill.core.kv.paged import PagedKVManager
from tokenmill.core.kv.static import StaticKVManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.speculative import (
    SpeculativeConfig,
    max_draft_tokens,
    ngram_propose,
    num_tokens_to_propose,
)
from tokenmill.errors import ConfigError

BS = 4


def _req(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params))


# ---- config -----------------------------------------------------------------------------
def test_config_takes_vllms_fields_and_defaults_method() -> None:
    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
    )
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 5, 3)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_dict({"model": "/d", "num_speculative_tokens": 2}).method == (
        "draft_model"
    )
    assert EngineConfig(
        speculative_config={"num_speculative_tokens": 2}
    ).speculative == spec.__class__(num_speculative_tokens=2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"method": "eagle"}, "method 'eagle' is not supported"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        (
            {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "draft_model"}, "needs a model"),
        ({"method": "ngram", "model": "/x"}, "ngram takes no model"),
        ({"num_speculative_tokens": 2, "lookahead": 1}, "unknown field(s) ['lookahead']"),
    ],
)
def test_bad_config_is_one_clear_error(values: dict, message: str) -> None:
    with pytest.raises(ConfigError, match="--speculative-config") as info:
        EngineConfig(speculative_config=values)
    assert message in str(info.value)


# ---- n-gram proposals -------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] last occurred at 6..7, followed by 7, 8, 5
    assert ngram_propose(tokens, 3, 1, 4) == [7, 8, 5]
    # a longer suffix wins over a later shorter match: [5, 2, 3] never recurs, [2, 3] does
    assert ngram_propose([4, 5, 6, 4, 5], 2, 1, 3) == [6, 4]
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []
    assert ngram_propose([1, 2, 1], 3, 2, 3) == []  # only a 1-token suffix recurs


def test_proposals_never_exceed_what_the_request_may_still_produce() -> None:
    req = _req("r", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], max_tokens=3)
    req.output_token_ids = [3]
    assert max_draft_tokens(req) == 1  # one more token comes from the target itself
    req.output_token_ids = [3, 4]
    assert max_draft_tokens(req) == 0


def test_policy_shrinks_proposals_as_the_batch_grows() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=8)
    ks = [num_tokens_to_propose(spec, n) for n in range(1, 11)]
    assert ks[:4] == [4, 4, 4, 4]
    assert ks == sorted(ks, reverse=True)
    assert ks[7] >= 1 and ks[8:] == [0, 0]


# ---- scheduling and rollback ------------------------------------------------------------
def _decode_ready(sched: Scheduler, *requests: Request) -> None:
    """Prefill the requests and append one sampled token each, as the engine would."""
    for req in requests:
        sched.add_request(req)
    out = sched.schedule()
    sched.update_after_step(out.scheduled)
    for req in requests:
        req.append_output_token(50)


def test_drafts_are_scheduled_with_the_last_token_and_rolled_back() -> None:
    kv = PagedKVManager(num_blocks=16, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = _req("r", list(range(7)))
    _decode_ready(sched, req)
    req.num_spec_tokens = 4
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 5}
    assert len(kv.block_table("r")) == 3  # 12 token slots: 8 known + 4 drafts
    sched.update_after_step(out.scheduled)
    req.append_output_token(60)  # one draft accepted, then the target's own token
    req.append_output_token(70)
    sched.rollback_unverified(req)
    assert req.num_spec_tokens == 0
    assert req.num_computed_tokens == req.num_tokens - 1 == 9
    assert len(kv.block_table("r")) == 3
    check_invariants(kv, {"r": req})
    # nothing accepted: the block that only drafts reached is released
    req.num_spec_tokens = 3
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 4}
    sched.update_after_step(out.scheduled)
    req.append_output_token(80)
    sched.rollback_unverified(req)
    assert req.num_computed_tokens == 10
    assert len(kv.block_table("r")) == 3
    check_invariants(kv, {"r": req})


def test_drafts_that_do_not_fit_the_budget_are_cut() -> None:
    kv = PagedKVManager(num_blocks=16, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=3)
    req = _req("r", [1, 2, 3])
    _decode_ready(sched, req)
    req.num_spec_tokens = 4
    assert sched.schedule().num_scheduled_tokens == {"r": 3}
    assert req.num_spec_tokens == 2


def test_drafts_are_dropped_before_anyone_is_preempted() -> None:
    kv = PagedKVManager(num_blocks=2, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _req("a", [1, 2, 3]), _req("b", [5, 6, 7])
    _decode_ready(sched, a, b)
    a.num_spec_tokens = 3  # would need a third block
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.preempted_ids == [] and a.num_spec_tokens == 0


def test_a_draft_models_catch_up_is_charged_to_the_budget() -> None:
    """draft_model: proposing d tokens costs the target 1 + d and the draft its lag plus
    d - 1; what does not fit is trimmed, and a lag longer than the budget is caught up in
    chunks (no proposal meanwhile) until the draft can propose again."""
    kv = PagedKVManager(num_blocks=16, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=12, draft_model=True)
    req = _req("r", list(range(7)))
    _decode_ready(sched, req)
    assert req.num_draft_lag == 8  # the draft has read nothing: prompt + the first output
    req.num_spec_tokens = 3
    out = sched.schedule()
    # d = 2: target 3 tokens, draft 8 (catch-up) + 1 = 12; d = 3 would need 14
    assert out.num_scheduled_tokens == {"r": 3} and req.num_spec_tokens == 2
    assert out.draft_catch_up == {"r": 8} and out.num_draft_model_tokens == 9
    # the draft read 8 tokens, then its first draft: 9 tokens with draft KV
    req.num_draft_computed_tokens = 9
    sched.update_after_step(out.scheduled)
    req.append_output_token(70)  # the first draft rejected, the target's own token instead
    sched.rollback_unverified(req)
    assert req.num_draft_lag == 1  # the draft's KV is valid up to the verified tokens
    req.num_spec_tokens = 3
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 4} and out.draft_catch_up == {"r": 1}
    assert out.num_draft_model_tokens == 3  # 1 + 2 draft inputs; 4 + 3 <= 12

    # a lag longer than the budget: chunks of catch-up, the target decoding meanwhile
    sched = Scheduler(
        PagedKVManager(num_blocks=16, block_size=BS),
        max_num_seqs=4,
        max_num_batched_tokens=6,
        draft_model=True,
    )
    long = _req("l", list(range(20)))
    sched.add_request(long)
    for _ in range(4):  # chunked prefill of the 20-token prompt
        out = sched.schedule()
        sched.update_after_step(out.scheduled)
    long.append_output_token(50)
    caught_up = []
    while True:
        long.num_spec_tokens = 2
        out = sched.schedule()
        assert out.total_num_tokens + out.num_draft_model_tokens <= 6
        if long.num_spec_tokens:
            break
        assert out.num_scheduled_tokens == {"l": 1}
        caught_up.append(out.draft_catch_up["l"])
        long.num_draft_computed_tokens += out.draft_catch_up["l"]
        sched.update_after_step(out.scheduled)
        long.append_output_token(51)
    # 5 a step (the budget less the target's token) while the target decodes on, then the
    # last 2 tokens with a proposal of 2: 1 + 2 for the target, 2 + 1 for the draft
    assert caught_up == [5, 5, 5, 5, 4]
    assert out.draft_catch_up == {"l": 2} and long.num_spec_tokens == 2


def test_static_slots_take_drafts_without_bookkeeping() -> None:
    kv = StaticKVManager(num_slots=2, max_model_len=32, block_size=BS)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    req = _req("r", [1, 2, 3])
    _decode_ready(sched, req)
    req.num_spec_tokens = 2
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r": 3}
    sched.update_after_step(out.scheduled)
    req.append_output_token(9)
    sched.rollback_unverified(req)
    assert req.num_computed_tokens == 4
    sched.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert kv._slot_tokens[kv._free_slots[-1]] == [1, 2, 3, 50]  # verified tokens only


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    num_blocks=st.integers(3, 24),
    prefix_caching=st.booleans(),
    draft_model=st.booleans(),
)
def test_rollback_never_leaks_or_double_frees(
    seed: int, num_blocks: int, prefix_caching: bool, draft_model: bool
) -> None:
    """Random drafts, random accept lengths, finishes and preemption over a small pool: the
    ref counts always match the block tables, every table holds exactly the computed tokens,
    and every cached block holds verified tokens only. With a draft model, its tokens and
    the target's never exceed the step's budget."""
    rng = random.Random(seed)
    kv = PagedKVManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=prefix_caching)
    budget = rng.randint(4, 32)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, draft_model=draft_model)
    shared = [rng.randrange(10) for _ in range(rng.randint(0, 9))]
    next_id = 0
    for _ in range(40):
        if len(sched.requests) < 4 and rng.random() < 0.4:
            tail = [rng.randrange(10) for _ in range(rng.randint(1, 6))]
            sched.add_request(_req(f"r{next_id}", shared + tail, max_tokens=rng.randint(1, 20)))
            next_id += 1
        for req in sched.running:
            if req.num_computed_tokens == req.num_tokens - 1:
                req.num_spec_tokens = min(rng.randint(0, 5), max_draft_tokens(req))
        out = sched.schedule()
        assert out.total_num_tokens + out.num_draft_model_tokens <= budget
        for req, _ in out.scheduled:  # the draft reads what it was granted
            if req.request_id in out.draft_catch_up:
                start = req.num_tokens - req.num_draft_lag
                req.num_draft_computed_tokens = start + out.draft_catch_up[req.request_id]
                if req.num_spec_tokens:
                    assert req.num_draft_computed_tokens == req.num_tokens
                    req.num_draft_computed_tokens += req.num_spec_tokens - 1
        sched.update_after_step(out.scheduled)
        for req, _ in out.scheduled:
            drafts = [rng.randrange(10) for _ in range(req.num_spec_tokens)]
            if req.num_computed_tokens < req.num_tokens + len(drafts):
                assert not drafts
                continue  # a prefill chunk that does not reach the end
            accepted = drafts[: rng.randint(0, len(drafts))]
            status = None
            for token in [*accepted, rng.randrange(10)]:
                status = req.append_output_token(token)
                if status is not None:
                    sched.finish_request(req.request_id, status)
                    break
            sched.rollback_unverified(req)
        if sched.running and rng.random() < 0.1:
            victim = rng.choice(sched.running)
            sched.finish_request(victim.request_id, RequestStatus.FINISHED_ABORTED)
        live = {r.request_id: r for r in sched.running}
        check_invariants(kv, live)
        for rid, req in live.items():
            for i, block_id in enumerate(kv.block_table(rid)):
                block = kv.pool.blocks[block_id]
                if block.token_ids is not None:
                    assert (i + 1) * BS <= req.num_tokens
                    assert block.token_ids == tuple(req.token_slice(i * BS, (i + 1) * BS))
    for rid in list(sched.requests):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == num_blocks
