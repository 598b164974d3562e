# One 16 x 128 prompt burst (max_tokens 1) through LLMEngine under torch.profiler, as run:
#   STEP=1024 QUANT=int4 PYTHONPATH=src .venv/bin/python results/int4-prompt-step-profile-2026-12-07/step16.py MODEL_DIR
# (QUANT empty: bf16; STEP: max_num_batched_tokens, 1024 the CPU default)
import os, sys, time, torch
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
model = sys.argv[1]
eng = LLMEngine(EngineConfig.from_kwargs(model=model, kv_cache="paged", max_num_seqs=16, max_model_len=2048, num_threads=2, kv_cache_memory="1GiB", max_num_batched_tokens=int(os.environ.get("STEP", "2048")), quantization=os.environ.get("QUANT") or None))
P = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
n=[0]
def add(k, L):
    for _ in range(k):
        i = n[0]; n[0] += 1
        eng.add_request(str(i), [4 + (i * 7919 + t * 31) % 30000 for t in range(L)], P)
def drain():
    while eng.has_unfinished_requests(): eng.step()
add(16,128); drain(); add(16,128); drain()
add(16, 128)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
    drain()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
