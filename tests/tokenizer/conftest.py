"""Tokenizer folders shared by the tokenizer tests, built once per session.

Two styles cover what real checkpoints ship: byte-level BPE (GPT-2, Llama 3, Qwen; built
like the demo model's tokenizer, on a small inline corpus) and SentencePiece-style BPE with byte fallback (Llama 2, Mistral),
whose decoder strips the leading space of a sequence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from tokenmill.model.demo import DEMO_CORPUS
from tokenmill.tokenizer import Tokenizer

# A Llama-2-style template: BOS from the template, strict role alternation.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def build_sentencepiece_style_tokenizer(folder: Path, vocab_size: int = 800) -> BackendTokenizer:
    """A Llama-2-like tokenizer.json: "▁" spaces, byte fallback, Strip decoder, BOS added."""
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    trainer_tok = BackendTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False
    )
    trainer_tok.train_from_iterator(DEMO_CORPUS.splitlines(), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    vocab = {token: i for i, token in enumerate(specials)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]

    tok = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    tok.save(str(folder / "tokenizer.json"))
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": {
                "__type": "AddedToken",
                "content": "<s>",
                "lstrip": False,
                "normalized": False,
                "special": True,
            },
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": LLAMA2_TEMPLATE,
        },
    )
    return tok


@pytest.fixture(scope="session")
def byte_level_dir(tokenizer_dir: Path) -> Path:
    """A byte-level BPE like the demo model's: ChatML template, BOS post-processor."""
    return tokenizer_dir


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-2-style tokenizer with byte fallback and a Strip decoder."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    build_sentencepiece_style_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def byte_level_tokenizer(byte_level_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(byte_level_dir)


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(sentencepiece_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(sentencepiece_dir)
