import os, sys, threading, time, statistics
from tokenmill.config import EngineConfig
from tokenmill.core.sampling_params import SamplingParams
from tokenmill.engine.llm_engine import LLMEngine
eng = LLMEngine(EngineConfig.from_kwargs(model=os.path.expanduser("~/.cache/tokenmill-real/smollm2-135m-instruct"),
    dtype="bfloat16", quantization=os.environ.get("Q") or None, max_num_seqs=4, max_model_len=200, num_threads=int(os.environ.get("NT", "0")) or None))
p = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("MT", "200")), ignore_eos=True)
def run(tag):
    eng.add_request(tag, list(range(4, 132)), p)
    ts = []
    while eng.has_unfinished_requests():
        s = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - s)
    print(tag, f"{statistics.median(ts[5:]) * 1e3:.2f} ms", flush=True)
mode = sys.argv[1]; print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"), __import__("torch").get_num_threads())
for i in range(2):
    if mode == "main":
        run(f"main{i}")
    else:
        t = threading.Thread(target=run, args=(f"thread{i}",)); t.start(); t.join()
