"""Benchmark workloads: the prompts and output lengths a run sends, built reproducibly.

Four sources, as in vLLM's ``bench serve``: ``random`` (token-id prompts of a chosen
length, as text too when a tokenizer is given), ``sharegpt`` (real conversations from a
ShareGPT-format JSON file), ``jsonl`` (one prompt per line, with an optional output
length) and ``prefix`` (a few shared system prompts followed by unique suffixes, to show
what prefix caching buys). Every builder is seeded, so two runs, or two targets in a
comparison, see the same requests. Warm-up requests are built here too: shaped like the
measured ones, but with prompts of their own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.tokenization import (
    TokenizerLike,
    decode_ids,
    encode_text,
    sample_token_ids_of,
    special_ids_of,
    vocab_size_of,
)

DATASET_NAMES: tuple[str, ...] = ("random", "sharegpt", "jsonl", "prefix")
"""Values accepted by ``--dataset``."""
_SHAREGPT_MIN_TOKENS = 4
_SHAREGPT_MAX_PROMPT_TOKENS = 1024
_SHAREGPT_MAX_TOTAL_TOKENS = 2048
_MAX_LENGTH_FIX_ROUNDS = 10
_CHARS_PER_TOKEN_ESTIMATE = 4
_WARMUP_STREAM = 1  # second entry of the warm-up RNG's seed: a stream apart from the workload's


@dataclass
class BenchRequest:
    """One prompt of a workload, as token ids, text, or both."""

    prompt_len: int
    """Prompt length in tokens (exact for token ids; an estimate for text without a tokenizer)."""
    output_len: int
    """Tokens to ask for (``max_tokens``)."""
    prompt_token_ids: list[int] | None = None
    """The prompt as token ids, when known; sent as-is to servers that accept ids."""
    prompt_text: str | None = None
    """The prompt as text, when known; needed by chat endpoints."""

    def __post_init__(self) -> None:
        if self.prompt_token_ids is None and self.prompt_text is None:
            raise ValueError("a BenchRequest needs prompt_token_ids or prompt_text")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


Length = int | tuple[int, int]
"""A token count, or an inclusive ``(low, high)`` range to draw uniformly from."""


def parse_length(text: str) -> Length:
    """``--input-len``/``--output-len`` values: ``256`` or a range ``16:1024``."""
    low, sep, high = text.partition(":")
    try:
        value: Length = (int(low), int(high)) if sep else int(text)
    except ValueError:
        raise ValueError(
            f"expected a token count like 256 or a range like 16:1024, got {text!r}"
        ) from None
    if isinstance(value, tuple) and not 1 <= value[0] <= value[1]:
        raise ValueError(f"a length range needs 1 <= LOW <= HIGH, got {text!r}")
    return value


def _length_bounds(length: Length, range_ratio: float) -> tuple[int, int]:
    """An explicit range as given, else vLLM's ``[len * (1 - r), len * (1 + r)]``, at least 1."""
    if (length[0] if isinstance(length, tuple) else length) < 1:
        raise ValueError("input_len and output_len must be >= 1")
    if isinstance(length, tuple):
        return length
    low = max(int(length * (1 - range_ratio)), 1)
    high = max(int(length * (1 + range_ratio)), low)
    return low, high


def _allowed_ids(tokenizer: TokenizerLike | None, vocab_size: int | None) -> np.ndarray:
    """Token ids a random prompt may use: the vocabulary minus special tokens, or the
    tokenizer's sample ids when the vocabulary size is unknown (a server's tokenizer)."""
    special = special_ids_of(tokenizer) if tokenizer is not None else set()
    size = (
        vocab_size
        if vocab_size is not None
        else (vocab_size_of(tokenizer) if tokenizer is not None else None)
    )
    sample = sample_token_ids_of(tokenizer) if size is None and tokenizer is not None else None
    if sample:
        ids = np.array(sorted(set(sample) - special), dtype=np.int64)
    elif size is None or size < 1:
        raise ValueError("random prompts need a tokenizer (--tokenizer) or --vocab-size")
    else:
        ids = np.setdiff1d(
            np.arange(size, dtype=np.int64), np.array(sorted(special), dtype=np.int64)
        )
    if ids.size == 0:
        raise ValueError("the vocabulary has no non-special tokens to build prompts from")
    return ids


def _text_of_length(
    ids: list[int],
    tokenizer: TokenizerLike,
    rng: np.random.Generator,
    allowed_ids: np.ndarray,
) -> tuple[str, int]:
    """Text that re-tokenizes to about ``len(ids)`` tokens, and its actual token count.

    Decoding random ids and encoding the text back rarely gives the same length, so the
    text is trimmed or extended a few rounds, as vLLM does.
    """
    target_len = len(ids)
    text = decode_ids(tokenizer, ids)
    for _ in range(_MAX_LENGTH_FIX_ROUNDS):
        encoded = encode_text(tokenizer, text)
        if len(encoded) == target_len:
            return text, target_len
        if len(encoded) > target_len:
            encoded = encoded[:target_len]
        else:
            extra = rng.choice(allowed_ids, size=target_len - len(encoded)).tolist()
            encoded = encoded + extra
        text = decode_ids(tokenizer, encoded)
    return text, len(encode_text(tokenizer, text))


def build_random_requests(
    num_prompts: int,
    input_len: Length,
    output_len: Length,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
) -> list[BenchRequest]:
    """Random token-id prompts with lengths uniform in ``len * [1 - r, 1 + r]``, or in an
    explicit ``(low, high)`` range per side (e.g. prompts 16..1024, outputs 16..256).

    Without a tokenizer only token ids are built (``vocab_size`` is then required); with
    one, each prompt also gets a text form whose token count is ``prompt_len``.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    in_low, in_high = _length_bounds(input_len, range_ratio)
    out_low, out_high = _length_bounds(output_len, range_ratio)
    rng = np.random.default_rng(seed)
    allowed_ids = _allowed_ids(tokenizer, vocab_size)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    requests = []
    for prompt_len, out_len in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = rng.choice(allowed_ids, size=prompt_len).tolist()
        text = None
        if tokenizer is not None:
            text, _ = _text_of_length(ids, tokenizer, rng, allowed_ids)
        requests.append(BenchRequest(prompt_len, out_len, prompt_token_ids=ids, prompt_text=text))
    return requests


def build_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int = 4,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
) -> list[BenchRequest]:
    """Prompts made of one of ``num_prefixes`` shared prefixes plus a unique suffix.

    The shared part stands for a system prompt: a server with prefix caching computes
    its KV once per prefix, which shows up as lower TTFT. Requests are shuffled so the
    prefixes interleave, as real traffic would.
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError("num_prefixes, prefix_len, suffix_len and output_len must be >= 1")
    rng = np.random.default_rng(seed)
    allowed_ids = _allowed_ids(tokenizer, vocab_size)
    prefixes = [rng.choice(allowed_ids, size=prefix_len).tolist() for _ in range(num_prefixes)]
    prefix_texts = (
        [_text_of_length(p, tokenizer, rng, allowed_ids)[0] for p in prefixes]
        if tokenizer is not None
        else []
    )
    requests = []
    for i in rng.permutation(num_prompts).tolist():
        which = i % num_prefixes
        suffix = rng.choice(allowed_ids, size=suffix_len).tolist()
        text = None
        prompt_len = prefix_len + suffix_len
        if tokenizer is not None:
            suffix_text, _ = _text_of_length(suffix, tokenizer, rng, allowed_ids)
            text = prefix_texts[which] + "\n" + suffix_text
            prompt_len = len(encode_text(tokenizer, text))
        requests.append(
            BenchRequest(
                prompt_len, output_len, prompt_token_ids=prefixes[which] + suffix, prompt_text=text
            )
        )
    return requests


def _count_tokens(text: str, tokenizer: TokenizerLike | None) -> int:
    """Exact count with a tokenizer, else a chars/4 estimate (the server's usage corrects it)."""
    if tokenizer is not None:
        return len(encode_text(tokenizer, text))
    return max(1, math.ceil(len(text) / _CHARS_PER_TOKEN_ESTIMATE))


def _sharegpt_turns(entry: Any) -> list[str]:
    """The turn texts of one ShareGPT entry (``from``/``value`` or ``role``/``content``)."""
    if not isinstance(entry, dict):
        return []
    turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages") or []
    texts = []
    for turn in turns:
        if isinstance(turn, dict):
            value = turn.get("value", turn.get("content"))
            if isinstance(value, str):
                texts.append(value)
    return texts


def load_sharegpt_requests(
    path: str | Path,
    num_prompts: int,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """First user turn as prompt, first reply's length as output length, vLLM's filters.

    Conversations with fewer than two turns are skipped, as are prompts or replies under
    4 tokens, prompts over 1024 tokens and pairs over 2048. ``output_len`` overrides the
    reply length for every request.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    order = np.random.default_rng(seed).permutation(len(data)).tolist()
    requests: list[BenchRequest] = []
    for i in order:
        if len(requests) >= num_prompts:
            break
        turns = _sharegpt_turns(data[i])
        if len(turns) < 2:
            continue
        prompt, reply = turns[0], turns[1]
        prompt_len = _count_tokens(prompt, tokenizer)
        reply_len = output_len if output_len is not None else _count_tokens(reply, tokenizer)
        if output_len is None and (
            prompt_len < _SHAREGPT_MIN_TOKENS or reply_len < _SHAREGPT_MIN_TOKENS
        ):
            continue
        if (
            prompt_len > _SHAREGPT_MAX_PROMPT_TOKENS
            or prompt_len + reply_len > _SHAREGPT_MAX_TOTAL_TOKENS
        ):
            continue
        requests.append(BenchRequest(prompt_len, reply_len, prompt_text=prompt))
    if not requests:
        raise ValueError(f"{path}: no conversation passed the ShareGPT filters")
    return _cycle_to(requests, num_prompts)


def _parse_jsonl_line(
    line: str, where: str, default_output_len: int
) -> tuple[str | list[int], int]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    out_len = default_output_len
    if isinstance(item, dict):
        prompt = item.get("prompt", item.get("text"))
        for key in ("output_len", "output_tokens", "max_tokens"):
            if item.get(key) is not None:
                out_len = item[key]
                break
    else:
        prompt = item
    is_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
    if not (isinstance(prompt, str) and prompt) and not (is_ids and prompt):
        raise ValueError(f"{where}: expected a non-empty prompt string or token-id list")
    if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
        raise ValueError(f"{where}: output length must be a positive integer, got {out_len!r}")
    return prompt, out_len


def load_jsonl_requests(
    path: str | Path,
    num_prompts: int,
    output_len: int,
    tokenizer: TokenizerLike | None = None,
) -> list[BenchRequest]:
    """One request per line: ``{"prompt": str | [ids], "output_len": N}`` or a bare string.

    ``output_len`` (also read as ``output_tokens`` or ``max_tokens``) defaults to the
    given value. Lines are used in file order; blank lines are skipped.
    """
    requests: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            prompt, out_len = _parse_jsonl_line(line, f"{path}:{line_no}", output_len)
            if isinstance(prompt, str):
                requests.append(
                    BenchRequest(_count_tokens(prompt, tokenizer), out_len, prompt_text=prompt)
                )
            else:
                text = decode_ids(tokenizer, prompt) if tokenizer is not None else None
                requests.append(
                    BenchRequest(len(prompt), out_len, prompt_token_ids=prompt, prompt_text=text)
                )
            if len(requests) >= num_prompts:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return _cycle_to(requests, num_prompts)


def _cycle_to(requests: list[BenchRequest], num_prompts: int) -> list[BenchRequest]:
    """Repeat a short dataset until it has ``num_prompts`` requests (as vLLM oversamples)."""
    return [requests[i % len(requests)] for i in range(num_prompts)]


def _warmup_token_pool(requests: list[BenchRequest], tokenizer: TokenizerLike | None) -> np.ndarray:
    """Distinct token ids the workload's prompts use (encoded from text with a tokenizer), minus special ones."""
    ids: set[int] = set()
    for r in requests:
        if r.prompt_token_ids is not None:
            ids.update(r.prompt_token_ids)
        elif tokenizer is not None:
            ids.update(encode_text(tokenizer, r.prompt_text or ""))
    if tokenizer is not None:
        ids -= special_ids_of(tokenizer)
    return np.array(sorted(ids), dtype=np.int64)


def build_warmup_requests(
    requests: list[BenchRequest],
    num_warmups: int,
    seed: int = 0,
    tokenizer: TokenizerLike | None = None,
) -> list[BenchRequest]:
    """Uncounted requests shaped like the measured ones, with prompts of their own.

    Warming up on measured prompts would leave their KV in the target's prefix cache, so
    the measured run would skip prefill that another engine recomputes. Warm-up ``i``
    keeps the prompt length, output length and prompt form (ids, text or both) of
    measured request ``i % len(requests)``; its tokens are drawn, on a stream apart from
    the workload's, among the tokens the workload uses (its words, for text without a
    tokenizer), so they are valid and never special.
    """
    if num_warmups <= 0:
        return []
    if not requests:
        raise ValueError("warm-up requests are shaped like the measured ones: give at least one")
    rng = np.random.default_rng([seed, _WARMUP_STREAM])
    token_pool = _warmup_token_pool(requests, tokenizer)
    word_pool = sorted({w for r in requests for w in (r.prompt_text or "").split()})
    warmups = []
    for i in range(num_warmups):
        shape = requests[i % len(requests)]
        prompt_len = shape.prompt_len
        ids: list[int] | None = None
        text: str | None = None
        if token_pool.size and (shape.prompt_token_ids is not None or tokenizer is not None):
            ids = rng.choice(token_pool, size=max(prompt_len, 1)).tolist()
            if shape.prompt_text is not None and tokenizer is not None:
                text, text_len = _text_of_length(ids, tokenizer, rng, token_pool)
                prompt_len = prompt_len if shape.prompt_token_ids is not None else text_len
        if shape.prompt_text is not None and text is None:
            num_words = max(len(shape.prompt_text.split()), 1)
            text = (
                " ".join(rng.choice(word_pool, size=num_words).tolist())
                if word_pool
                else shape.prompt_text
            )
        warmups.append(
            BenchRequest(
                prompt_len,
                shape.output_len,
                prompt_token_ids=ids if shape.prompt_token_ids is not None else None,
                prompt_text=text,
            )
        )
    return warmups


def build_requests(
    dataset: str,
    num_prompts: int,
    *,
    input_len: Length = 1024,
    output_len: Length = 128,
    range_ratio: float = 0.0,
    seed: int = 0,
    dataset_path: str | Path | None = None,
    tokenizer: TokenizerLike | None = None,
    vocab_size: int | None = None,
    prefix_len: int = 256,
    num_prefixes: int = 4,
    output_len_is_set: bool = True,
) -> list[BenchRequest]:
    """Dispatch on ``--dataset``: the one entry point the CLI and comparisons use.

    ``output_len_is_set`` False lets ShareGPT keep each conversation's own reply length.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if dataset in ("sharegpt", "jsonl") and dataset_path is None:
        raise ValueError(f"--dataset {dataset} needs --dataset-path FILE")
    if dataset != "random" and (isinstance(input_len, tuple) or isinstance(output_len, tuple)):
        raise ValueError(f"length ranges (LOW:HIGH) apply to --dataset random only, not {dataset}")
    if dataset == "random":
        return build_random_requests(
            num_prompts, input_len, output_len, range_ratio, seed, tokenizer, vocab_size
        )
    assert not isinstance(input_len, tuple) and not isinstance(output_len, tuple)  # refused above
    if dataset == "prefix":
        return build_prefix_requests(
            num_prompts,
            prefix_len,
            input_len,
            output_len,
            num_prefixes,
            seed,
            tokenizer,
            vocab_size,
        )
    if dataset == "sharegpt":
        assert dataset_path is not None  # refused above
        return load_sharegpt_requests(
            dataset_path, num_prompts, seed, tokenizer, output_len if output_len_is_set else None
        )
    if dataset == "jsonl":
        assert dataset_path is not None  # refused above
        return load_jsonl_requests(dataset_path, num_prompts, output_len, tokenizer)
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASET_NAMES)}")
