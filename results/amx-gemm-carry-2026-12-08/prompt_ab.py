import os, sys, time, statistics
from pathlib import Path
import tokenmill
sys.path.insert(0, "/work/main/benchmarks")
from engine_core import DEFAULT_MODEL_DIR, build_model
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine

model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "250m" else str(build_model(DEFAULT_MODEL_DIR))
values = ["flush", "carry"]
reps = int(os.environ.get("REPS", "10"))
engine = LLMEngine(EngineConfig.from_kwargs(model=model, dtype="bfloat16", kv_cache="paged", max_num_seqs=8, max_model_len=2048))
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
vocab = engine.model_config.vocab_size - 4
res = {v: [] for v in values}
salt = [0]
def once():
    salt[0] += 1
    prompt = [4 + (salt[0] * 7919 + t * 31) % vocab for t in range(1024)]
    engine.add_request(f"r{salt[0]}", prompt, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0
once(); once()
for rep in range(reps):
    for v in values[rep % len(values):] + values[:rep % len(values)]:
        if v == "flush": os.environ["TM_NO_CARRY2"] = "1"
        else: os.environ.pop("TM_NO_CARRY2", None)
        res[v].append(once())
base = statistics.median(res[values[0]])
print(" ".join(f"{v}: {statistics.median(res[v])*1e3:.1f} ms ({statistics.median(res[v])/base:.3f})" for v in values))
