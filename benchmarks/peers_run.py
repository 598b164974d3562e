"""Peers and fallback in one prepared, resumable run: tokenmill against vLLM's CPU backend,
llama.cpp and Transformers, every server on the same cores, one server at a time.

Steps (``--list`` prints them with their estimated minutes on a quiet 2-core machine):

  prepare            build the 250M benchmark Llama (engine_core.py's, seeded) and the ~360M
                     random Mixtral (moe.py --shape full), convert the Llama to GGUF
                     (gguf_convert.py), compile tokenmill's CPU kernels, check out --ref
  A (peers)          the 250M Llama through each server with ``tokenmill bench serve``:
                     single = 6 x (128 -> 64) at 1 stream, many = 32 x (128 -> 64) at 16
                     streams, long = 16 x (1024 -> 64) at 8 streams; greedy, EOS ignored.
                     a-vllm-bf16, a-tm-bf16 (paged), a-tm-bf16-static, a-tm-bf16-lat and
                     a-tm-bf16-static-lat (--max-num-seqs 4, single only), a-tm-fp32, a-tm-int8, a-tm-int4
                     (--quantization, --dtype auto), a-tm-{bf16,int8,int4}-compiled (paged with
                     --compile-batch-sizes 1, single only), a-llama-f16/q8_0/q4_0, a-ref-bf16 (with
                     --ref: the same tokenmill bf16 server from a worktree of an older commit);
                     v-verify: ``tokenmill verify`` at bf16, int8 and int4 (the report's
                     verify column: top-1 agreement and KL against float32 transformers)
  B (fallback)       b-fallback: tokenmill bf16 --model-impl transformers on the 250M Llama
                     (single, many; against a-tm-bf16); b-moe-offline: moe.py in bf16,
                     tokenmill (with the share of step time in routing and expert dispatch,
                     timed inside the engine's steps) and Transformers generate, at 1 and 16
                     streams; b-moe-tm and b-moe-vllm: the MoE served, 4 x (128 -> 64) at 1
                     stream and 32 x (128 -> 64) at 16
  rounds             a-rounds: vLLM CPU bf16 and tokenmill bf16 (and --ref's) up at once, each
                     on its own port; --rounds rounds, each running many and long through all
                     of them back to back, the order rotated per round: the 1.2x targets as
                     ratios within a round, met only where they hold in every round
                     (peers_rounds.py; --round-servers adds tm-int8, tm-int4)
  report             markdown tables with side-by-side ratios, the commands, CPU flags, date

Each step writes ``OUT/<step>.json`` (a failed step too, with its error and the server log's
tail, and the run goes on); ``--skip-done`` skips steps whose JSON has no error, so a run
that stopped resumes where it was. Peak RSS is the server's process tree (summed RSS: vLLM's
engine runs in a child process), over its whole life and while measured.

    .venv/bin/python benchmarks/peers_run.py --ref 9abb3a3^ --skip-done   # everything
    .venv/bin/python benchmarks/peers_run.py --only A --skip-done         # peers only
    .venv/bin/python benchmarks/peers_run.py --only report                # tables again
    .venv/bin/python benchmarks/peers_run.py --model DIR --gguf-name NAME \
        --only prepare,a-rounds,report --rounds 4    # the vLLM targets on a noisy machine
    .venv/bin/python benchmarks/peers_run.py --tiny --out-dir results/peers-smoke  # smoke
    # a real checkpoint (convert it first: ../shared/peers/build-llamacpp.sh convert DIR NAME)
    .venv/bin/python benchmarks/peers_run.py --model DIR --gguf-name NAME \
        --only a-vllm-bf16,a-tm-bf16,a-tm-int8,a-tm-int4,v-verify,a-llama-f16,a-llama-q8_0,a-llama-q4_0,report
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE, PEERS_ROOT, REPO, source_env
from peers_pairs import step_pairs
from peers_plan import (
    FULL_WORKLOADS,
    PRECISIONS,
    THREADS,
    TINY_WORKLOADS,
    Context,
    Step,
    git,
    load,
)
from peers_report import render_report
from peers_rounds import DEFAULT_ROUNDS, DEFAULT_WORKLOADS, step_rounds
from peers_servers import llama_serve, serve_and_bench, tokenmill_serve, vllm_serve
from peers_verify import step_verify

HERE = Path(__file__).resolve().parent

LLAMA_TINY_SHAPE: dict[str, Any] = (
    dict(  # smoke tests only; head_dim 64 and multiples of 64 for the peers
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=32000,
        max_position_embeddings=2048,
    )
)


# ---------------------------------------------------------------- steps


def step_prepare(ctx: Context) -> dict[str, Any]:
    py = sys.executable
    info: dict[str, Any] = {}
    for kind, folder in (("dense", ctx.dense), ("moe", ctx.moe)):
        start = time.monotonic()
        subprocess.run(
            [
                py,
                __file__,
                "--build-model",
                kind,
                str(folder),
                *(["--tiny"] if ctx.args.tiny else []),
            ],
            check=True,
        )
        info[f"{kind}_model"] = {"path": str(folder), "build_s": round(time.monotonic() - start, 1)}
        print(f"  {kind} model: {folder}", flush=True)
    if ctx.args.llama_server.is_file():
        subprocess.run(
            [py, str(HERE / "gguf_convert.py"), str(ctx.dense), ctx.gguf_name], check=True
        )
        info["gguf"] = sorted(str(p) for p in (PEERS_ROOT / "gguf").glob(f"{ctx.gguf_name}-*.gguf"))
        version = subprocess.run(
            [str(ctx.args.llama_server), "--version"], capture_output=True, text=True
        )
        info["llama_cpp_version"] = (version.stdout + version.stderr).strip().splitlines()[:2]
    else:
        info["gguf"] = f"skipped: no llama-server at {ctx.args.llama_server}"
    srcs = [("kernels", None)] + ([("ref_kernels", ctx.ref_src)] if ctx.ref_src else [])
    for key, src in srcs:
        start = time.monotonic()
        probe = subprocess.run(
            [py, "-c", "from tokenmill.kernels.build import load; print(load())"],
            env=source_env(src),
            capture_output=True,
            text=True,
        )
        info[key] = {
            "loaded": probe.stdout.strip() == "True",
            "note": (probe.stderr.strip().splitlines() or [""])[-1][:300],
            "seconds": round(time.monotonic() - start, 1),
        }
        print(f"  {key}: {info[key]}", flush=True)
    vllm_py = PEERS_ROOT / "vllm-venv/bin/python"
    if vllm_py.is_file():
        version = subprocess.run(
            [str(vllm_py), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
        )
        info["vllm_version"] = version.stdout.strip() or version.stderr.strip()[-300:]
    return info


def dense_server_step(
    flags: list[str],
    workloads: list[str],
    *,
    ref: bool = False,
    max_model_len: int = 2048,
    max_num_seqs: int = 32,
) -> Callable[[Context], dict[str, Any]]:
    def run(ctx: Context) -> dict[str, Any]:
        name = ctx.current
        command = tokenmill_serve(ctx.args.port, ctx.dense, flags, max_model_len, max_num_seqs)
        if ref:  # the older tree's tokenmill, with this interpreter and its packages
            command = ["env", f"PYTHONPATH={ctx.ref_src}", *command]
        result = serve_and_bench(ctx, name, command, workloads, tokenizer=ctx.dense)
        if ref:
            result["ref"] = ctx.args.ref
            result["ref_commit"] = git("rev-parse", ctx.args.ref)
        return result

    return run


def step_vllm_dense(ctx: Context) -> dict[str, Any]:
    command = vllm_serve(ctx, ctx.dense, 2048)
    return serve_and_bench(
        ctx, "a-vllm-bf16", command, ["single", "many", "long"], tokenizer=ctx.dense
    )


def llama_step(quant: str, long: bool) -> Callable[[Context], dict[str, Any]]:
    def run(ctx: Context) -> dict[str, Any]:
        gguf = PEERS_ROOT / "gguf" / f"{ctx.gguf_name}-{quant}.gguf"
        if not gguf.is_file():
            raise RuntimeError(f"{gguf} is missing: run the prepare step (needs llama.cpp built)")
        name = f"a-llama-{quant}"
        result = serve_and_bench(
            ctx, name, llama_serve(ctx, gguf, 16), ["single", "many"], tokenizer=ctx.dense
        )
        if long:  # 8 slots of 2048 tokens: a 1088-token request does not fit 16 of 1024
            long_result = serve_and_bench(
                ctx, name + "-long", llama_serve(ctx, gguf, 8), ["long"], tokenizer=ctx.dense
            )
            result["runs"].update(long_result["runs"])
            result["long_command"] = long_result["command"]
            result["long_peak_rss_gib"] = long_result["peak_rss_gib"]
        return result

    return run


def step_moe_offline(ctx: Context) -> dict[str, Any]:
    out = ctx.out / "raw" / "b-moe-offline.json"
    w1, w16 = ctx.workloads["moe1"], ctx.workloads["moe16"]
    command = [
        sys.executable,
        str(HERE / "moe.py"),
        "--model",
        str(ctx.moe),
        "--dtype",
        "bfloat16",
        "--prompt-len",
        str(w16.input_len),
        "--max-tokens",
        str(w16.output_len),
        "--streams",
        str(w1.concurrency),
        str(w16.concurrency),
        "--num-threads",
        str(THREADS),
        "--with-transformers",
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True)
    result: dict[str, Any] = {"command": shlex.join(command), **json.loads(out.read_text())}
    return result


def step_moe_tm(ctx: Context) -> dict[str, Any]:
    command = tokenmill_serve(ctx.args.port, ctx.moe, ["--dtype", "bfloat16"], 1024)
    return serve_and_bench(ctx, "b-moe-tm", command, ["moe1", "moe16"], tokenizer=ctx.moe)


def step_moe_vllm(ctx: Context) -> dict[str, Any]:
    return serve_and_bench(
        ctx, "b-moe-vllm", vllm_serve(ctx, ctx.moe, 1024), ["moe1", "moe16"], tokenizer=ctx.moe
    )


def step_report(ctx: Context) -> dict[str, Any]:
    text = render_report(ctx, STEPS)
    (ctx.out / "report.md").write_text(text)
    print(text)
    return {"report": str(ctx.out / "report.md")}


STEPS: list[Step] = [
    Step("prepare", "prepare", 4, step_prepare, "models, GGUF, kernels, --ref worktree"),
    Step("a-vllm-bf16", "A", 4, step_vllm_dense, "vLLM CPU bf16, every core"),
    Step(
        "a-tm-bf16",
        "A",
        2.5,
        dense_server_step(["--dtype", "bfloat16"], ["single", "many", "long"]),
        "tokenmill bf16, paged KV",
    ),
    Step(
        "a-ref-bf16",
        "A",
        2.5,
        dense_server_step(["--dtype", "bfloat16"], ["single", "many", "long"], ref=True),
        "tokenmill bf16 paged at --ref (same run, right after a-tm-bf16: no regression)",
    ),
    Step(
        "a-tm-bf16-static",
        "A",
        3,
        dense_server_step(
            ["--dtype", "bfloat16", "--kv-cache", "static"],
            ["single", "many"],
            max_model_len=512,
            max_num_seqs=16,
        ),
        "tokenmill bf16, static KV (compiled decode step)",
    ),
    Step(
        "a-tm-bf16-lat",
        "A",
        1,
        dense_server_step(["--dtype", "bfloat16"], ["single"], max_num_seqs=4),
        "tokenmill bf16 paged, latency config (--max-num-seqs 4)",
    ),
    Step(
        "a-tm-bf16-static-lat",
        "A",
        2,
        dense_server_step(
            ["--dtype", "bfloat16", "--kv-cache", "static"],
            ["single"],
            max_model_len=512,
            max_num_seqs=4,
        ),
        "tokenmill bf16 static, latency config (--max-num-seqs 4)",
    ),
    Step(
        "a-tm-fp32",
        "A",
        2.5,
        dense_server_step(["--dtype", "float32"], ["single", "many", "long"]),
        "tokenmill fp32, paged KV (dtype auto's choice on CPUs without native bf16)",
    ),
    Step(
        "a-tm-int8",
        "A",
        2.5,
        dense_server_step(["--quantization", "int8"], ["single", "many", "long"]),
        "tokenmill --quantization int8 (dtype auto)",
    ),
    Step(
        "a-tm-int4",
        "A",
        2.5,
        dense_server_step(["--quantization", "int4"], ["single", "many", "long"]),
        "tokenmill --quantization int4 (dtype auto)",
    ),
    *(
        Step(
            f"a-tm-{name}-compiled",
            "A",
            1.5,
            dense_server_step([*flags, "--compile-batch-sizes", "1"], ["single"], max_num_seqs=4),
            f"tokenmill {name} paged, its one-row decode step compiled (--compile-batch-sizes 1)",
        )
        for name, flags in PRECISIONS.items()
    ),
    Step(
        "v-verify",
        "A",
        6,
        step_verify,
        "tokenmill verify at bf16, int8 and int4 (top-1 and KL against float32 transformers)",
    ),
    Step("a-llama-f16", "A", 3, llama_step("f16", True), "llama.cpp f16"),
    Step("a-llama-q8_0", "A", 1.5, llama_step("q8_0", False), "llama.cpp Q8_0"),
    Step("a-llama-q4_0", "A", 1.5, llama_step("q4_0", False), "llama.cpp Q4_0"),
    Step(
        "a-pairs",
        "A",
        10,
        step_pairs,
        "one stream, tokenmill and llama.cpp alternating per precision, 3 rounds",
    ),
    Step(
        "a-rounds",
        "rounds",
        12,
        step_rounds,
        "vLLM CPU bf16 and tokenmill bf16 (and --ref) up at once, many and long alternating "
        "for --rounds rounds (peers_rounds.py)",
    ),
    Step(
        "b-fallback",
        "B",
        2,
        dense_server_step(
            ["--dtype", "bfloat16", "--model-impl", "transformers"], ["single", "many"]
        ),
        "tokenmill bf16 --model-impl transformers (against a-tm-bf16)",
    ),
    Step("b-moe-offline", "B", 4, step_moe_offline, "MoE offline: tokenmill shares, Transformers"),
    Step("b-moe-tm", "B", 2, step_moe_tm, "MoE served by tokenmill bf16"),
    Step("b-moe-vllm", "B", 3.5, step_moe_vllm, "MoE served by vLLM CPU bf16"),
    Step("report", "report", 0, step_report, "markdown tables"),
]


# ---------------------------------------------------------------- plumbing


def ref_worktree(ref: str) -> Path:
    """A detached worktree of ``ref`` under the cache (made once per commit); its src/."""
    commit = git("rev-parse", "--verify", ref + "^{commit}")
    if len(commit) != 40:
        raise SystemExit(f"--ref {ref}: not a commit ({commit})")
    folder = CACHE / "bench-ref" / commit[:12]
    if not (folder / "src" / "tokenmill").is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), commit],
            check=True,
            capture_output=True,
        )
    return folder / "src"


def build_model_inner(kind: str, folder: Path, tiny: bool) -> None:
    """In a child process (so the runner holds no weights): build one benchmark model."""
    if kind == "dense":
        if tiny:
            import transformers
            from _common import save_random_model

            save_random_model(
                folder,
                lambda: transformers.LlamaConfig(
                    **LLAMA_TINY_SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1
                ),
            )
        else:
            from engine_core import build_model

            build_model(folder)
    else:
        import moe

        moe.build_model(folder, moe.SHAPES["tiny" if tiny else "full"])


def select(args: argparse.Namespace) -> list[Step]:
    steps = [s for s in STEPS if s.name != "a-ref-bf16" or args.ref]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        steps = [s for s in steps if any(s.name == w or s.group == w for w in wanted)]
    if args.skip:
        unwanted = [w.strip() for w in args.skip.split(",")]
        steps = [s for s in steps if s.name not in unwanted and s.group not in unwanted]
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "peers")
    parser.add_argument("--only", help="comma list of steps or groups (prepare, A, B, report)")
    parser.add_argument("--skip", help="comma list of steps or groups to leave out")
    parser.add_argument("--skip-done", action="store_true", help="skip steps with a result")
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    parser.add_argument(
        "--ref", help="git ref of an older tokenmill for the a-ref-bf16 step, e.g. 9abb3a3^"
    )
    parser.add_argument("--port", type=int, default=8600, help="every server's port, in turn")
    parser.add_argument(
        "--pairs",
        help="a-pairs: a comma list of precisions to pair (bf16, int8, int4; all if unset)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help="a-rounds: how many rounds (each runs every workload through every server)",
    )
    parser.add_argument(
        "--round-servers",
        help="a-rounds: a comma list of vllm-bf16, tm-{bf16,int8,int4}, ref-{bf16,int8,int4} "
        "(default vllm-bf16,tm-bf16, and ref-bf16 with --ref); ports --port, --port+1, ...",
    )
    parser.add_argument(
        "--round-workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help="a-rounds: a comma list of workloads (single, many, long)",
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=PEERS_ROOT / "build-llama" / "bin" / "llama-server",
        help="llama.cpp's server binary (build-llamacpp.sh build)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="smoke test: tiny models and request counts"
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="an HF folder for the A steps instead of the 250M Llama (a real checkpoint, e.g. "
        "~/.cache/tokenmill-real/smollm2-135m-instruct); needs --gguf-name",
    )
    parser.add_argument(
        "--gguf-name",
        help="the name gguf_convert.py gave --model's GGUF files (PEERS/gguf/NAME-{f16,q8_0,q4_0}.gguf)",
    )
    parser.add_argument(
        "--build-model", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.model and not args.gguf_name:
        parser.error(
            "--model needs --gguf-name (its GGUF files' name), or llama.cpp runs another model"
        )
    if args.build_model:
        build_model_inner(args.build_model[0], Path(args.build_model[1]), args.tiny)
        return 0
    steps = select(args)
    if args.list:
        for s in steps:
            print(f"{s.name:18s} {s.group:8s} ~{s.minutes:4.1f} min  {s.describe}")
        print(f"total ~{sum(s.minutes for s in steps):.0f} min")
        return 0
    tiny = args.tiny
    ctx = Context(
        args=args,
        out=args.out_dir,
        workloads=TINY_WORKLOADS if tiny else FULL_WORKLOADS,
        dense=CACHE / ("bench-llama-tiny" if tiny else "bench-llama-250m"),
        moe=CACHE / ("bench-moe-tiny" if tiny else "bench-moe-360m"),
        gguf_name="llamatiny" if tiny else "llama250m",
    )
    if os.environ.get("TOKENMILL_BENCH_DENSE"):
        ctx.dense = Path(os.environ["TOKENMILL_BENCH_DENSE"])
    if args.model:
        if not args.gguf_name:
            parser.error(
                "--model needs --gguf-name (its GGUF files' name), or llama.cpp runs another model"
            )
        ctx.dense, ctx.gguf_name = args.model.expanduser(), args.gguf_name
    ctx.out.mkdir(parents=True, exist_ok=True)
    with (ctx.out / "invocations.txt").open("a") as f:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        f.write(f"{stamp}  cd {Path.cwd()} && {shlex.join([sys.executable, *sys.argv])}\n")
    if args.ref:
        ctx.ref_src = ref_worktree(args.ref)
    todo = [
        s
        for s in steps
        if not (
            args.skip_done
            and s.name != "report"
            and (d := load(ctx, s.name)) is not None
            and "error" not in d
        )
    ]
    total = sum(s.minutes for s in todo)
    print(
        f"{len(todo)} steps, about {total:.0f} min: {', '.join(s.name for s in todo)}", flush=True
    )
    run_start = time.monotonic()
    for i, step in enumerate(todo, 1):
        elapsed = (time.monotonic() - run_start) / 60
        print(
            f"[{i}/{len(todo)}] {step.name} (~{step.minutes} min; {elapsed:.1f} min elapsed) "
            f"{step.describe}",
            flush=True,
        )
        ctx.current = step.name
        started = time.gmtime()
        start = time.monotonic()
        try:
            result = step.run(ctx)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            log = ctx.out / "logs" / f"{step.name}.log"
            tail = (
                "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                if log.is_file()
                else ""
            )
            result = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
                "log_tail": tail,
            }
            print(f"  FAILED: {result['error']}\n{tail}", flush=True)
        result["_started"] = time.strftime("%Y-%m-%d %H:%M:%S", started)
        result["_ended"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        result["_wall_s"] = round(time.monotonic() - start, 1)
        result["_commit"] = git("rev-parse", "--short", "HEAD")  # a later report's HEAD may differ
        if step.name != "report":
            (ctx.out / f"{step.name}.json").write_text(json.dumps(result, indent=2))
        print(f"  done in {result['_wall_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
