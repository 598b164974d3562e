"""Verify's comparison maths (the engine-backed runs are tested in phase 2)."""

from __future__ import annotations

import pytest

from tokenmill.bench.verify import Generation, compare_generations, format_verify_report


def test_exact_matches_pass_with_logprob_difference() -> None:
    ref = [Generation([1, 2, 3], [-0.1, -0.2, -0.3]), Generation([4, 5], [-1.0, -2.0])]
    got = [Generation([1, 2, 3], [-0.1, -0.25, -0.3]), Generation([4, 5], [-1.0, -2.0])]
    report = compare_generations(ref, got)
    assert report.match_rate == 1.0 and report.passed
    assert report.max_logprob_diff == pytest.approx(0.05)
    assert [v.first_divergence for v in report.prompts] == [None, None]
    assert format_verify_report(report).endswith("PASS")


def test_divergence_position_and_rate() -> None:
    ref = [Generation([1, 2, 3, 4], [-0.1] * 4), Generation([7, 8], [-0.5, None])]
    got = [Generation([1, 2, 9, 9], [-0.1, -0.3, -5.0, -5.0]), Generation([7, 8], [-0.5, -0.1])]
    report = compare_generations(ref, got, min_match=1.0)
    assert report.match_rate == 0.5 and not report.passed
    assert report.prompts[0].first_divergence == 2
    # Only the agreeing prefix counts; positions after the divergence are different tokens.
    assert report.prompts[0].max_logprob_diff == pytest.approx(0.2)
    text = format_verify_report(report)
    assert "diverges at token 2 (transformers 3, tokenmill 9)" in text and text.endswith("FAIL")
    assert compare_generations(ref, got, min_match=0.5).passed


def test_length_mismatch_diverges_at_the_shorter_end() -> None:
    report = compare_generations(
        [Generation([1, 2, 3], [None] * 3)], [Generation([1, 2], [None] * 2)]
    )
    assert report.prompts[0].first_divergence == 2 and report.max_logprob_diff is None
    with pytest.raises(ValueError):
        compare_generations([Generation([1], [None])], [])
