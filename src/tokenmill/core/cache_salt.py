"""Prefix-cache salts: which requests may reuse each other's cached KV blocks.

Two requests share cached blocks only when their ``Request.cache_salt`` is equal: the paged
strategy hashes it into every block's chained hash, the static one compares it per slot. A
salt is composed here from named parts (the API key, the client's vLLM ``cache_salt``, the
LoRA adapter, the request itself). Each part is length-prefixed before the whole is digested,
so no value of one part can spell another combination: a client's ``cache_salt`` cannot land
in another key's or another adapter's namespace. The digest is what the engine keeps, so a
salt is 64 hex characters whatever the client sent, and no part (a client secret, a hash
of an API key) sits in requests, block tables or logs. No torch.
"""

from __future__ import annotations

import hashlib

from tokenmill.errors import InvalidRequestError

CACHE_SALT_ERROR = "Parameter 'cache_salt' must be a non-empty string if provided."
"""vLLM's message for a ``cache_salt`` that is not a non-empty string (its protocol check)."""


def check_cache_salt(value: object) -> str | None:
    """A request's ``cache_salt`` as vLLM accepts it: absent (None) or a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(CACHE_SALT_ERROR, param="cache_salt")
    return value


def compose_salt(*parts: tuple[str, str | None]) -> str | None:
    """The salt of ``(name, value)`` parts, those with value None left out; None when none is
    left (such a request shares blocks with every other unsalted one)."""
    given = [(name, value) for name, value in parts if value is not None]
    if not given:
        return None
    h = hashlib.sha256(b"tokenmill-cache-salt")
    for name, value in given:
        for field in (name.encode(), value.encode("utf-8", "surrogatepass")):
            h.update(len(field).to_bytes(8, "big"))
            h.update(field)
    return h.hexdigest()
