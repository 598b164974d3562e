"""The ``copy`` workload of the speculative decoding benchmarks: rewrite prompts
whose greedy answers do repeat the prompt.

The workload wanted: "prompts whose answers repeat parts of the prompt, e.g. 'rewrite this
text' with the demo corpus". The 3.8M-parameter demo model cannot copy arbitrary text: on
"Rewrite this text: <two corpus lines>\\nRewritten: <first sentence>" its greedy answer
continued a 3-gram of the prompt in 1% of output tokens (16 x 64 tokens, float32), so
prompt lookup only found the demo's own loops (``copy_corpus``, kept for comparison). Here
the text to rewrite is two corpus lines followed by the demo's own greedy continuation of
them (96 tokens), and the answer starts again with the two lines: the demo then writes
what it wrote before, and 70% of its output tokens continue a prompt 3-gram. The passages
are fixed text in ``copy_passages.json`` (so llama.cpp and vLLM get the same prompts);
regenerate with ``PYTHONPATH=src python benchmarks/copy_workload.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.model.demo import DEMO_CORPUS

PASSAGES = Path(__file__).resolve().parent / "copy_passages.json"
LINES_PER_PROMPT = 2
CONTINUATION_TOKENS = 96


def corpus_passages(num: int, lines_per_prompt: int = LINES_PER_PROMPT) -> list[str]:
    """``num`` passages of consecutive corpus lines (wrapping around)."""
    lines = DEMO_CORPUS.strip().splitlines()
    return [
        " ".join(lines[(i + j) % len(lines)] for j in range(lines_per_prompt)) for i in range(num)
    ]


def copy_corpus_prompts(num: int) -> list[str]:
    """The original rewrite prompts over corpus lines (the demo rarely copies them)."""
    prompts = []
    for passage in corpus_passages(num):
        prompts.append(f"Rewrite this text: {passage}\nRewritten: {passage.split('.')[0]}")
    return prompts


def copy_prompts(num: int) -> list[str]:
    """Rewrite prompts over the stored passages (corpus lines + the demo's continuation)."""
    rows = json.loads(PASSAGES.read_text())
    prompts = []
    for i in range(num):
        row = rows[i % len(rows)]
        text = row["lines"] + row["continuation"]
        prompts.append(f"Rewrite this text: {text}\nRewritten: {row['lines']}")
    return prompts


def copy_share(prompt_ids: list[int], output_ids: list[int]) -> float:
    """Share of output tokens that continue a 3-gram of the prompt (how copy-heavy)."""
    trigrams = {tuple(prompt_ids[i : i + 3]) for i in range(len(prompt_ids) - 2)}
    seq = prompt_ids + output_ids
    hits = sum(tuple(seq[j - 2 : j + 1]) in trigrams for j in range(len(prompt_ids), len(seq)))
    return hits / max(1, len(output_ids))


def build_passages(num: int = 32) -> list[dict[str, str]]:
    """The demo's greedy float32 continuation of each corpus passage."""
    from tokenmill.core.sampling_params import SamplingParams
    from tokenmill.entrypoints.llm import LLM

    llm = LLM("demo", dtype="float32", max_model_len=1024, max_num_seqs=16)
    bases = corpus_passages(num)
    params = SamplingParams(temperature=0.0, max_tokens=CONTINUATION_TOKENS, ignore_eos=True)
    outs = llm.generate(bases, params, use_tqdm=False)
    return [
        {"lines": b, "continuation": o.outputs[0].text} for b, o in zip(bases, outs, strict=True)
    ]


if __name__ == "__main__":
    PASSAGES.write_text(json.dumps(build_passages(), indent=1) + "\n")
    print(f"wrote {PASSAGES}")
