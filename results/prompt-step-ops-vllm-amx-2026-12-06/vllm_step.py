# One prompt step of vLLM CPU in process (VLLM_ENABLE_V1_MULTIPROCESSING=0, both cores), as run:
#   VLLM=~/.cache/tokenmill-peers/vllm-venv; $VLLM/bin/python vllm_step.py MODEL_DIR 1024 --prof
# times 5 x generate(1 x 1024 tokens, max_tokens=1) and 5 x (16 x 128), then torch.profiler over one 1 x 1024.
import os, sys, time, statistics
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model = sys.argv[1]; L = int(sys.argv[2]) if len(sys.argv) > 2 else 1024; prof = "--prof" in sys.argv
kw = {}
if os.environ.get("MNBT"): kw["max_num_batched_tokens"] = int(os.environ["MNBT"])
llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, max_num_seqs=16, **kw)
V = 30000
P = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
n = [0]
def prompts(k, L):
    out = []
    for _ in range(k):
        i = n[0]; n[0] += 1
        out.append(TokensPrompt(prompt_token_ids=[4 + (i * 7919 + t * 31) % V for t in range(L)]))
    return out
llm.generate(prompts(2, L), P, use_tqdm=False)
for case, k, LL in (("1x%d" % L, 1, L), ("16x128", 16, 128)):
    ts = []
    for r in range(5):
        ps = prompts(k, LL); t = time.perf_counter(); llm.generate(ps, P, use_tqdm=False); ts.append((time.perf_counter() - t) * 1e3)
    print(f"vllm {case} ms:", [round(x) for x in ts], "median", round(statistics.median(ts)))
if prof:
    ps = prompts(1, L)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        llm.generate(ps, P, use_tqdm=False)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
