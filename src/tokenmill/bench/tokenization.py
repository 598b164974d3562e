"""How the bench tools turn text into token ids with whatever tokenizer the user has.

A ``tokenizers.Tokenizer``, a ``transformers`` tokenizer and tokenmill's own tokenizer
disagree on what ``encode`` returns and which keyword drops special tokens. These
adapters hide that, so datasets and the serve client can count and build prompts with
any of them. Loading never touches the network: only local folders or files are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tokenmill.model.source import resolve_model_path


class TokenizerLike(Protocol):
    """Anything with ``encode(text)`` and ``decode(ids)``; the return types may vary."""

    # Positional-only, so implementations may name the parameters as they like (token_ids...).
    def encode(self, text: str, /, *args: Any, **kwargs: Any) -> Any: ...

    # A str for one flat list of ids; transformers types it str | list[str] (batches).
    def decode(self, ids: list[int], /, *args: Any, **kwargs: Any) -> Any: ...


def encode_text(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Token ids of ``text`` without BOS/EOS, so counts match what a completion adds."""
    try:
        result = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword adds nothing to strip
        result = tokenizer.encode(text)
    if hasattr(result, "ids"):  # tokenizers.Encoding
        result = result.ids
    elif isinstance(result, dict) and "input_ids" in result:
        result = result["input_ids"]
    return [int(t) for t in result]


def decode_ids(tokenizer: TokenizerLike, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens dropped when the tokenizer supports that."""
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(list(ids))


def vocab_size_of(tokenizer: TokenizerLike) -> int | None:
    """Size of the vocabulary including added tokens, or None when it cannot be told."""
    get_size = getattr(tokenizer, "get_vocab_size", None)
    if callable(get_size):
        try:
            return int(get_size(with_added_tokens=True))
        except TypeError:
            return int(get_size())
    try:
        return len(tokenizer)  # type: ignore[arg-type]
    except TypeError:
        pass
    size = getattr(tokenizer, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def sample_token_ids_of(tokenizer: TokenizerLike) -> list[int] | None:
    """Ids to draw random prompts from when the vocabulary size is unknown (a server's
    tokenizer offers the ids of a sample text); None for tokenizers without them."""
    sample = getattr(tokenizer, "sample_token_ids", None)
    return [int(i) for i in sample()] if callable(sample) else None


def special_ids_of(tokenizer: TokenizerLike) -> set[int]:
    """Ids of special tokens, kept out of random prompts so they decode to real text."""
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is not None:
        return {int(i) for i in ids}
    get_added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if callable(get_added):
        return {int(i) for i, tok in get_added().items() if getattr(tok, "special", False)}
    return set()


def load_tokenizer(name_or_path: str | Path) -> TokenizerLike:
    """Load a tokenizer from a local model folder, ``tokenizer.json`` file, or ``demo``.

    A model folder is read with tokenmill's own tokenizer, so prompts get the ids a
    tokenmill server would give them; a bare ``tokenizer.json`` uses the ``tokenizers``
    library; ``transformers`` is the last resort for folders with only slow files.
    """
    path = resolve_model_path(str(name_or_path))
    if path.is_file() and path.suffix == ".json":
        from tokenizers import Tokenizer as BackendTokenizer

        return BackendTokenizer.from_file(str(path))
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {str(name_or_path)!r} is not a local folder or tokenizer.json; "
            "pass --tokenizer PATH (the bench tools never download)"
        )
    if (path / "tokenizer.json").is_file():
        from tokenmill.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(path)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise FileNotFoundError(
            f"no tokenizer.json in {path} and transformers is not installed"
        ) from exc
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
