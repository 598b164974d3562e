"""Convert the demo model and its draft to GGUF for llama.cpp (benchmarks/spec_decode.py).

llama.cpp's ``convert_hf_to_gguf.py`` refuses BPE tokenizers whose pre-tokenizer it has no
hash for; the demo's (byte-level, GPT-2's split regex) is GPT-2's, so that name is given.

The converter needs ``sentencepiece`` importable (it tries that vocabulary first and only
falls back to GPT-2's BPE on a missing file), which tokenmill's venv does not install:

    .venv/bin/pip install --target /tmp/sp sentencepiece
    PYTHONPATH=/tmp/sp .venv/bin/python benchmarks/gguf_convert_demo.py
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

PEERS = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache" / "tokenmill-peers"))
SRC = PEERS / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
MODELS = Path(__file__).resolve().parent.parent / "src" / "tokenmill" / "model"


def main() -> None:
    sys.path[:0] = [str(SRC / "gguf-py"), str(SRC)]
    import conversion.base as base  # llama.cpp's converter package

    for cls in vars(base).values():
        if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
            cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    (PEERS / "gguf").mkdir(parents=True, exist_ok=True)
    for folder, name in (("demo_weights", "tm-demo"), ("demo_draft_weights", "tm-demo-draft")):
        out = PEERS / "gguf" / f"{name}-f32.gguf"
        sys.argv = ["convert_hf_to_gguf.py", str(MODELS / folder), "--outtype", "f32"]
        sys.argv += ["--outfile", str(out)]
        runpy.run_path(str(SRC / "convert_hf_to_gguf.py"), run_name="__main__")
        print(out)


if __name__ == "__main__":
    main()
