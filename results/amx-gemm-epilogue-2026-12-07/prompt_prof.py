import sys, time
import tokenmill
import torch
from pathlib import Path
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
M=Path.home()/".cache/tokenmill/bench-llama-250m"
eng=LLMEngine(EngineConfig.from_kwargs(model=str(M),dtype="bfloat16",kv_cache="paged",max_num_seqs=8,enable_prefix_caching=False))
sp=SamplingParams(max_tokens=1,temperature=0.0,ignore_eos=True)
import random
def prompt(seed):
    r=random.Random(seed); return [r.randrange(2,32000) for _ in range(1024)]
def one(seed):
    eng.add_request(f"r{seed}", {"prompt_token_ids":prompt(seed)} if False else prompt(seed), sp)
    t=time.perf_counter()
    while eng.has_unfinished_requests(): eng.step()
    return time.perf_counter()-t
for i in range(3): one(i)
ts=[one(10+i) for i in range(6)]
print("prompt step ms", sorted(ts)[3]*1e3)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
    for i in range(4): one(100+i)
print(prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=12))
