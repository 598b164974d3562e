"""The model as start-up resolves it: what reading its tokenizer leaves resident."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from tokenmill.model.host_memory import trim_freed_heap

_GROWTH = """
import sys
from tokenmill.resolved_model import read_tokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
before = anon()
tokenizer = (read_tokenizer if sys.argv[2] == "read_tokenizer" else Tokenizer.from_pretrained)(sys.argv[1])
assert tokenizer.vocab_size > 0
print(anon() - before)
"""


def _large_bpe_folder(folder: Path, vocab_size: int) -> Path:
    """A BPE tokenizer of ``vocab_size`` entries (letters, then every merge of a token and a
    letter, level by level): a large vocabulary's JSON to parse, as Gemma 3's 262,144."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {c: i for i, c in enumerate(letters)}
    merges: list[tuple[str, str]] = []
    level = letters
    while len(vocab) < vocab_size:
        longer = []
        for token in level:
            for c in letters:
                if len(vocab) < vocab_size:
                    vocab[token + c] = len(vocab)
                    merges.append((token, c))
                    longer.append(token + c)
        level = longer
    backend = BackendTokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    return folder


def _growth(folder: Path, how: str) -> int:
    """RssAnon a fresh process gains loading ``folder``'s tokenizer ``how``."""
    out = subprocess.run(
        [sys.executable, "-c", _GROWTH, str(folder), how],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc/self/status")
def test_reading_a_large_tokenizer_hands_back_what_parsing_it_freed(tmp_path: Path) -> None:
    """Parsing tokenizer.json frees its JSON tree once the vocabulary is built; without the
    trim glibc keeps it resident (a 100,000-entry vocabulary: ~2x the tokenizer itself)."""
    if not trim_freed_heap():
        pytest.skip("no glibc malloc_trim here")
    folder = _large_bpe_folder(tmp_path / "large", 100_000)
    plain = _growth(folder, "from_pretrained")
    trimmed = _growth(folder, "read_tokenizer")
    assert trimmed < 0.75 * plain, (trimmed / 2**20, plain / 2**20)
