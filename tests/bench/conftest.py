"""Fixtures of the bench tests: a char-level tokenizer and a fake streaming server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

import pytest

from tests.bench.fake_openai_server import FakeBehavior, FakeServer

ALPHABET = "abcdefghijklmnopqrstuvwxyz "


class CharTokenizer:
    """One token per letter or space: exact, reversible counts for dataset maths.

    Id 27 is a special token (like EOS) that decodes to nothing.
    """

    all_special_ids = [27]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ALPHABET.index(c) for c in text if c in ALPHABET]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids if i < len(ALPHABET))

    def __len__(self) -> int:
        return len(ALPHABET) + 1


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture(scope="session")
def _fake_server_session() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture
def fake_server(_fake_server_session: FakeServer) -> FakeServer:
    """The shared fake server with its behavior reset to the defaults."""
    defaults = FakeBehavior()
    for f in fields(FakeBehavior):
        setattr(_fake_server_session.behavior, f.name, getattr(defaults, f.name))
    return _fake_server_session
