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


def test_verify_by_default_checks_what_serve_runs_and_shows_text(capsys) -> None:
    """No --dtype: tokenmill runs in the dtype `serve` picks here; a reduced precision is judged
    by teacher-forced agreement and KL (exact greedy text only reported), with text shown."""
    from tokenmill.bench.verify import served_dtype
    from tokenmill.entrypoints.cli import main

    served = served_dtype("demo")
    code = main(["verify", "--max-tokens", "8", "--num-prompts", "2"])
    captured = capsys.readouterr()
    if served == "float32":
        assert "exact match:" in captured.out
    else:
        assert f"tokenmill (dtype={served}" in captured.out and "top-1 agreement" in captured.out
        assert "exact greedy text:" in captured.out and "reported, not judged" in captured.out
        assert "first prompt, tokenmill:" in captured.out
        assert f"--dtype auto is {served}" in captured.err
    assert code == 0


def test_offline_and_verify_default_to_serves_dtype() -> None:
    import argparse

    from tokenmill.bench.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["verify"]).dtype == "auto"
    assert parser.parse_args(["bench", "offline", "--model", "demo"]).dtype == "auto"


def test_served_dtype_takes_the_auto_device() -> None:
    """bench offline's default ``--device auto`` resolves as the engine resolves it (it was
    handed to torch.device as is and failed)."""
    import torch

    from tokenmill.bench.verify import served_dtype

    on_auto = served_dtype("demo", "auto", "auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert on_auto == served_dtype("demo", "auto", expected)
