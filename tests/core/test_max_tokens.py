"""core/max_tokens.py: the one rule bounding what a request may generate."""

from __future__ import annotations

import pytest

from tokenmill.core.max_tokens import bounded, capped, clamp, output_room
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.errors import ContextLengthError


def test_output_room_is_the_context_left_and_refuses_a_prompt_that_fills_it() -> None:
    assert output_room(10, 64, "ctx") == 54
    assert output_room(63, 64, "ctx") == 1
    with pytest.raises(
        ContextLengthError, match=r"^ctx\. However, your prompt has 64 tokens, leaving"
    ):
        output_room(64, 64, "ctx")


def test_bounded_and_capped() -> None:
    assert bounded(None, 5) == 5 and bounded(3, 5) == 3 and bounded(9, 5) == 5
    assert capped(None, None) is None and capped(7, None) == 7
    assert capped(None, 4) == 4 and capped(7, 4) == 4 and capped(2, 4) == 2


def test_clamp_keeps_params_within_room_and_min_tokens_under_max_tokens() -> None:
    params = SamplingParams(max_tokens=4, min_tokens=2)
    assert clamp(params, 4) is params
    cut = clamp(SamplingParams(max_tokens=10, min_tokens=8), 5)
    assert (cut.max_tokens, cut.min_tokens) == (5, 5)
    assert clamp(SamplingParams(max_tokens=None), 3).max_tokens == 3
