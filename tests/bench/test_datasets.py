"""Workload builders: lengths, reproducibility, text forms and file formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.datasets import (
    BenchRequest,
    build_prefix_requests,
    build_random_requests,
    build_requests,
    build_warmup_requests,
    load_jsonl_requests,
    load_sharegpt_requests,
)
from tokenmill.bench.tokenization import decode_ids, encode_text, load_tokenizer


def test_random_lengths_stay_in_range_and_replay(char_tokenizer) -> None:
    requests = build_random_requests(
        200, input_len=20, output_len=10, range_ratio=0.5, seed=3, vocab_size=1000
    )
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.output_len <= 15 for r in requests)
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in requests)
    assert len({r.prompt_len for r in requests}) > 5  # the range is actually used
    again = build_random_requests(
        200, input_len=20, output_len=10, range_ratio=0.5, seed=3, vocab_size=1000
    )
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in requests]
    other = build_random_requests(
        200, input_len=20, output_len=10, range_ratio=0.5, seed=4, vocab_size=1000
    )
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests]


def test_random_without_range_has_exact_lengths_and_no_text() -> None:
    requests = build_random_requests(10, input_len=7, output_len=3, vocab_size=50)
    assert {(r.prompt_len, r.output_len) for r in requests} == {(7, 3)}
    assert all(r.prompt_text is None and max(r.prompt_token_ids) < 50 for r in requests)


def test_random_with_tokenizer_has_text_of_the_stated_length(char_tokenizer) -> None:
    requests = build_random_requests(
        20, input_len=12, output_len=4, seed=1, tokenizer=char_tokenizer
    )
    for r in requests:
        assert r.prompt_text is not None
        assert len(encode_text(char_tokenizer, r.prompt_text)) == r.prompt_len == 12
        assert 27 not in r.prompt_token_ids  # special tokens are never drawn


def test_random_needs_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab"):
        build_random_requests(1, 4, 4)
    with pytest.raises(ValueError, match="range_ratio"):
        build_random_requests(1, 4, 4, range_ratio=1.0, vocab_size=10)


def test_prefix_requests_share_a_few_prefixes(char_tokenizer) -> None:
    requests = build_prefix_requests(
        12,
        prefix_len=8,
        suffix_len=4,
        output_len=5,
        num_prefixes=3,
        seed=0,
        tokenizer=char_tokenizer,
    )
    prefixes = {tuple(r.prompt_token_ids[:8]) for r in requests}
    suffixes = {tuple(r.prompt_token_ids[8:]) for r in requests}
    assert len(prefixes) == 3 and len(suffixes) == 12
    text_prefixes = {r.prompt_text.split("\n")[0] for r in requests}
    assert len(text_prefixes) == 3
    assert all(r.output_len == 5 and len(r.prompt_token_ids) == 12 for r in requests)


def _write_sharegpt(path: Path) -> None:
    data = [
        {
            "conversations": [
                {"from": "human", "value": "tell me about the sea please"},
                {"from": "gpt", "value": "the sea is wide and deep and blue"},
            ]
        },
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "a long enough reply"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "what is a tokenizer exactly"},
                {"role": "assistant", "content": "it splits text into pieces"},
            ]
        },
    ]
    path.write_text(json.dumps(data))


def test_sharegpt_applies_vllm_filters(tmp_path: Path, char_tokenizer) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    requests = load_sharegpt_requests(path, num_prompts=10, tokenizer=char_tokenizer)
    texts = {r.prompt_text for r in requests}
    # One-turn and too-short ("hi" is 2 tokens) conversations are dropped; the rest cycle to 10.
    assert texts == {"tell me about the sea please", "what is a tokenizer exactly"}
    assert len(requests) == 10
    sea = next(r for r in requests if r.prompt_text.startswith("tell"))
    assert sea.prompt_len == len("tell me about the sea please")
    assert sea.output_len == len("the sea is wide and deep and blue")
    fixed = load_sharegpt_requests(path, num_prompts=2, tokenizer=char_tokenizer, output_len=7)
    assert {r.output_len for r in fixed} == {7}


def test_sharegpt_without_tokenizer_estimates_lengths(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    requests = load_sharegpt_requests(path, num_prompts=2)
    assert all(r.prompt_len >= 1 and r.prompt_token_ids is None for r in requests)


def test_jsonl_formats_and_errors(tmp_path: Path, char_tokenizer) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hello there", "output_len": 9}\n\n"a bare string"\n{"prompt": [1, 2, 3]}\n'
    )
    requests = load_jsonl_requests(path, num_prompts=3, output_len=4, tokenizer=char_tokenizer)
    assert [(r.prompt_text, r.output_len) for r in requests[:2]] == [
        ("hello there", 9),
        ("a bare string", 4),
    ]
    assert requests[2].prompt_token_ids == [1, 2, 3] and requests[2].prompt_text == "bcd"
    assert requests[0].prompt_len == 11
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_jsonl_requests(bad, num_prompts=5, output_len=4)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_jsonl_requests(bad, num_prompts=5, output_len=4)


def test_build_requests_dispatch(tmp_path: Path) -> None:
    assert len(build_requests("random", 3, input_len=4, output_len=2, vocab_size=10)) == 3
    assert (
        len(build_requests("prefix", 3, input_len=4, output_len=2, vocab_size=10, prefix_len=5))
        == 3
    )
    with pytest.raises(ValueError, match="dataset-path"):
        build_requests("sharegpt", 3)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_requests("nope", 3)
    with pytest.raises(ValueError):
        BenchRequest(prompt_len=1, output_len=1)


def test_load_tokenizer_reads_a_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog"] * 20,
        trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "</s>"]),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    ids = encode_text(loaded, "the lazy fox")
    assert ids and decode_ids(loaded, ids).replace(" ", "") == "thelazyfox"
    with pytest.raises(FileNotFoundError, match="never download"):
        load_tokenizer(tmp_path / "missing")


def test_warmups_are_shaped_like_the_measured_requests_but_never_repeat_a_prompt(
    char_tokenizer,
) -> None:
    measured = build_random_requests(
        4, input_len=12, output_len=5, range_ratio=0.5, seed=0, vocab_size=50
    )
    warmups = build_warmup_requests(measured, 6, seed=0)
    assert [(w.prompt_len, w.output_len) for w in warmups] == [
        (measured[i % 4].prompt_len, measured[i % 4].output_len) for i in range(6)
    ]
    measured_prompts = {tuple(r.prompt_token_ids) for r in measured}
    assert all(len(w.prompt_token_ids) == w.prompt_len and w.prompt_text is None for w in warmups)
    assert not measured_prompts & {tuple(w.prompt_token_ids) for w in warmups}
    # Drawn among the workload's own tokens, reproducibly per seed.
    assert {t for w in warmups for t in w.prompt_token_ids} <= {
        t for r in measured for t in r.prompt_token_ids
    }
    assert [w.prompt_token_ids for w in build_warmup_requests(measured, 6, seed=0)] == [
        w.prompt_token_ids for w in warmups
    ]
    assert build_warmup_requests(measured, 0) == []


def test_warmups_of_text_workloads_have_text_of_their_own(char_tokenizer) -> None:
    with_text = build_random_requests(
        3, input_len=10, output_len=4, seed=1, tokenizer=char_tokenizer
    )
    for measured, warmup in zip(
        with_text,
        build_warmup_requests(with_text, 3, seed=1, tokenizer=char_tokenizer),
        strict=True,
    ):
        assert warmup.prompt_text and warmup.prompt_text != measured.prompt_text
        assert len(encode_text(char_tokenizer, warmup.prompt_text)) == measured.prompt_len
        assert warmup.prompt_token_ids != measured.prompt_token_ids
    text_only = [
        BenchRequest(5, 3, prompt_text="the cat sat on the mat"),
        BenchRequest(3, 2, prompt_text="a dog ran"),
    ]
    warmups = build_warmup_requests(text_only, 2, seed=0)  # no tokenizer: words of the workload
    assert [w.prompt_token_ids for w in warmups] == [None, None]
    assert [len(w.prompt_text.split()) for w in warmups] == [6, 3]
    assert [w.prompt_text for w in warmups] != [r.prompt_text for r in text_only]


def test_length_ranges_per_side() -> None:
    from tokenmill.bench.datasets import parse_length

    assert parse_length("256") == 256 and parse_length("16:1024") == (16, 1024)
    for bad in ("0:5", "9:3", "a:b", "x"):
        with pytest.raises(ValueError):
            parse_length(bad)
    requests = build_random_requests(
        400, input_len=(16, 1024), output_len=(16, 256), vocab_size=1000, seed=1
    )
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in requests)
    assert 16 <= min(prompt_lens) < 80 and 960 < max(prompt_lens) <= 1024
    assert 16 <= min(output_lens) < 30 and 240 < max(output_lens) <= 256
    with pytest.raises(ValueError, match="random only"):
        build_requests("prefix", 4, input_len=(4, 8), vocab_size=1000)
