"""Convert a tokenmill benchmark model (byte-level BPE tokenizer) to GGUF for llama.cpp.

llama.cpp's ``convert_hf_to_gguf.py`` identifies a BPE pre-tokenizer by hashing how it
splits a test string, and refuses tokenizers it has not seen, as it has not seen the demo
model's byte-level BPE (trained for tokenmill, GPT-2's splitting rules). This runs that
converter with the answer filled in (``gpt-2``) and then ``llama-quantize`` for Q8_0 and
Q4_0, writing where ``build-llamacpp.sh serve`` looks:

    ../shared/peers/build-llamacpp.sh build      # once, ~10 min
    .venv/bin/python benchmarks/gguf_convert.py ~/.cache/tokenmill/bench-llama-250m llama250m

The converter runs in the peers' own Python environment (it needs torch, transformers and
numpy beside llama.cpp's ``gguf-py``): ``$PEERS_PYTHON``, else ``build-llamacpp.sh``'s venv,
else vLLM CPU's (``vllm-cpu.sh install``); the script re-executes itself there.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache/tokenmill-peers"))
VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
SRC = ROOT / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def peers_python() -> str:
    """The interpreter the converter runs in (see the module docstring)."""
    if os.environ.get("PEERS_PYTHON"):
        return os.environ["PEERS_PYTHON"]
    for venv in ("venv", "vllm-venv"):
        if (ROOT / venv / "bin/python").is_file():
            return str(ROOT / venv / "bin/python")
    raise SystemExit(f"no Python for llama.cpp's converter under {ROOT}: set PEERS_PYTHON")


def convert(hf_dir: str, name: str) -> None:
    out_dir = ROOT / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    for outtype in ("f32", "f16"):
        target = out_dir / f"{name}-{outtype}.gguf"
        if not target.is_file():
            subprocess.run(
                [peers_python(), __file__, "--inner", hf_dir, outtype, str(target)],
                check=True,
                env={**os.environ, "PYTHONPATH": str(SRC / "gguf-py")},
            )
    for quant in ("Q8_0", "Q4_0"):
        target = out_dir / f"{name}-{quant.lower()}.gguf"
        if not target.is_file():
            subprocess.run(
                [
                    str(ROOT / "build-llama/bin/llama-quantize"),
                    str(out_dir / f"{name}-f32.gguf"),
                    str(target),
                    quant,
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    for f in sorted(out_dir.glob(f"{name}-*.gguf")):
        print(f, f.stat().st_size)


def inner(hf_dir: str, outtype: str, target: str) -> None:
    """Inside the peers' venv: llama.cpp's converter, told the pre-tokenizer."""
    # Not this folder: a module here named like a package transformers probes would shadow it.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(SRC))
    from conversion import base  # llama.cpp's own module

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", outtype, "--outfile", target]
    runpy.run_path(str(SRC / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == "--inner":
        inner(*sys.argv[2:5])
    else:
        convert(sys.argv[1], sys.argv[2])
