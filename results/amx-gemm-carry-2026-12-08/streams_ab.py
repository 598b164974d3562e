import os, sys, time, statistics
import tokenmill
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
model = sys.argv[1]
streams = int(sys.argv[2]) if len(sys.argv) > 2 else 16
engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype="bfloat16", kv_cache="paged", max_num_seqs=streams, max_model_len=2048))
params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
vocab = engine.model_config.vocab_size - 4
salt = [0]
def batch():
    for i in range(streams):
        salt[0] += 1
        engine.add_request(f"r{salt[0]}", [4 + (salt[0] * 7919 + t * 31) % vocab for t in range(128)], params)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter(); engine.step(); steps.append(time.perf_counter() - t0)
    return statistics.median(steps[-40:])
batch()
res = {"flush": [], "carry": []}
for rep in range(int(os.environ.get("REPS", "8"))):
    for m in (("flush", "carry") if rep % 2 == 0 else ("carry", "flush")):
        if m == "flush": os.environ["TM_NO_CARRY2"] = "1"
        else: os.environ.pop("TM_NO_CARRY2", None)
        res[m].append(batch())
a, b = statistics.median(res["flush"]), statistics.median(res["carry"])
print(f"{os.path.basename(model)} x{streams} decode step median: flush {a*1e3:.2f} ms carry {b*1e3:.2f} ms ratio {b/a:.3f}")
