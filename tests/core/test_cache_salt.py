"""Prefix-cache salts: how parts compose, and that both KV strategies keep salted requests apart."""

from __future__ import annotations

import pytest

from tokenmill.core.cache_salt import CACHE_SALT_ERROR, check_cache_salt, compose_salt
from tokenmill.core.kv.paged import PagedKVManager, hash_block
from tokenmill.core.kv.static import StaticKVManager
from tokenmill.core.request import Request
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequestError

BS = 4
PROMPT = list(range(13))


def _req(rid: str, salt: str | None) -> Request:
    return Request(rid, list(PROMPT), SamplingParams(), cache_salt=salt)


def _run(kv: PagedKVManager | StaticKVManager, req: Request) -> None:
    """Admit like the scheduler, compute the whole prompt, finish: its blocks stay cached."""
    hit = kv.lookup_prefix(req)
    assert kv.allocate(req, req.num_tokens - hit.num_tokens, hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)


def test_no_parts_is_no_salt() -> None:
    assert compose_salt() is None
    assert compose_salt(("api_key", None), ("client", None)) is None


def test_a_salt_is_a_fixed_size_digest_of_its_parts() -> None:
    salt = compose_salt(("client", "x" * 100_000))
    assert salt is not None and len(salt) == 64
    assert "x" not in salt
    assert compose_salt(("client", "a")) == compose_salt(("client", "a"))
    assert compose_salt(("client", "a")) != compose_salt(("client", "b"))


def test_no_part_value_can_spell_another_combination() -> None:
    """Length prefixes: a client salt cannot impersonate a key, an adapter or a split."""
    key = compose_salt(("api_key", "k1"))
    assert compose_salt(("client", "k1")) != key
    assert compose_salt(("api_key", "k"), ("client", "1")) != key
    assert compose_salt(("api_key", "k1"), ("client", "x")) != compose_salt(("api_key", "k1x"))
    assert compose_salt(("caller", "lora:1")) != compose_salt(("lora", "lora:1"))


@pytest.mark.parametrize("value", ["", 0, 1, b"salt", ["a"], {"a": 1}, True])
def test_check_refuses_what_vllm_refuses(value: object) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_cache_salt(value)
    assert err.value.param == "cache_salt"
    assert err.value.message == CACHE_SALT_ERROR


def test_check_takes_none_and_any_non_empty_string() -> None:
    assert check_cache_salt(None) is None
    assert check_cache_salt(" ") == " "  # vLLM only refuses the empty string


def test_the_salt_changes_the_first_block_hash_and_so_every_later_one() -> None:
    block = (1, 2, 3, 4)
    plain, salted = hash_block(None, None, block), hash_block(None, "s", block)
    assert plain != salted
    assert hash_block(plain, None, block) != hash_block(salted, None, block)


@pytest.mark.parametrize("kind", ["paged", "static"])
def test_only_requests_with_the_same_salt_reuse_cached_blocks(kind: str) -> None:
    kv: PagedKVManager | StaticKVManager = (
        PagedKVManager(num_blocks=32, block_size=BS)
        if kind == "paged"
        else StaticKVManager(num_slots=2, max_model_len=32, block_size=BS)
    )
    salt_a, salt_b = compose_salt(("api_key", "a")), compose_salt(("api_key", "b"))
    _run(kv, _req("a1", salt_a))
    assert kv.lookup_prefix(_req("b1", salt_b)).num_tokens == 0  # another key
    assert kv.lookup_prefix(_req("u1", None)).num_tokens == 0  # unsalted
    assert kv.lookup_prefix(_req("a2", salt_a)).num_tokens >= 2 * BS  # the same key
