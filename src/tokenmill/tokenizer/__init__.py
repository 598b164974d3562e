"""Tokenization: the model's tokenizer, chat templates and streaming detokenization."""

from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
