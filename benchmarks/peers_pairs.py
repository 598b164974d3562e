"""peers_run.py's a-pairs step: one stream, tokenmill and llama.cpp at the same precision
back to back, per precision and round. Kept apart from the runner, as the other alternating
comparison (``peers_rounds.py``) is."""

from __future__ import annotations

from typing import Any

from _common import PEERS_ROOT
from peers_plan import PRECISIONS, Context
from peers_servers import llama_serve, serve_and_bench, tokenmill_serve

PAIR_ROUNDS = 3
PAIRS = tuple(
    (name, PRECISIONS[name], quant)
    for name, quant in (("bf16", "f16"), ("int8", "q8_0"), ("int4", "q4_0"))
)
"""a-pairs: tokenmill's precision, its flags, and llama.cpp's quantization beside it."""


def step_pairs(ctx: Context) -> dict[str, Any]:
    """One stream, tokenmill and llama.cpp at the same precision back to back, PAIR_ROUNDS
    rounds: this machine's bandwidth drifts by up to 2x within minutes, so one pair of
    numbers a few minutes apart can say either; the ratio within each pair, over rounds, says
    which is faster."""
    rounds: list[dict[str, Any]] = []
    for r in range(PAIR_ROUNDS):
        row: dict[str, Any] = {}
        for name, flags, quant in PAIRS:
            if ctx.args.pairs and name not in ctx.args.pairs.split(","):
                continue
            gguf = PEERS_ROOT / "gguf" / f"{ctx.gguf_name}-{quant}.gguf"
            if not gguf.is_file():
                raise RuntimeError(f"{gguf} is missing: run the prepare step")
            command = tokenmill_serve(ctx.args.port, ctx.dense, flags, 2048)
            ours = serve_and_bench(
                ctx, f"a-pairs-{r}-tm-{name}", command, ["single"], tokenizer=ctx.dense
            )
            theirs = serve_and_bench(
                ctx,
                f"a-pairs-{r}-llama-{quant}",
                llama_serve(ctx, gguf, 16),
                ["single"],
                tokenizer=ctx.dense,
            )
            row[name] = {
                "tokenmill_tpot_ms": ours["runs"]["single"]["mean_tpot_ms"],
                "llama_tpot_ms": theirs["runs"]["single"]["mean_tpot_ms"],
                "llama_quant": quant,
            }
        rounds.append(row)
    return {"rounds": rounds, "tokenmill_flags": {n: f for n, f, _ in PAIRS}}
