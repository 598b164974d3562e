"""Memory sizes as people write them: ``4GiB``, ``512MiB``, ``2G``, plain bytes, or a fraction.

One parser for the command line (``--kv-cache-memory 4GiB``) and for configs built in Python
(``LLM(model, kv_cache_memory="256MiB")``), so both accept the same spellings and refuse the
same mistakes with the same words.
"""

from __future__ import annotations

import re

UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
"""Unit suffixes (lower case): SI powers of ten and IEC powers of two."""

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> float:
    """``0.3`` (a fraction, kept as is), ``4GiB``, ``512MiB``, ``2G`` or plain bytes.

    Raises ``ValueError`` with the message a user should see.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS:
        raise ValueError(
            f"invalid memory size {text!r}: use a fraction like 0.3 or a size like 4GiB"
        )
    value = float(match.group(1)) * UNITS[unit]
    if value <= 0:
        raise ValueError("memory size must be positive")
    return value
