#!/bin/bash
# Tenth pass (AVX2 machine): tokenmill against vLLM CPU and llama.cpp in one run, after the fused decode step,
# the bench's 5 s /metrics polling and the one-channel int4 row kernel. Pairs of the same precision run back to back.
cd /work/main
date -u +"start %F %T UTC"
PYTHONPATH=src .venv/bin/python benchmarks/wave3_peers.py --only a-tm-bf16,a-llama-f16,a-tm-int8,a-llama-q8_0,a-tm-int4,a-llama-q4_0,a-vllm-bf16,a-tm-bf16-static,a-tm-bf16-static-lat,report --out-dir results/wave3j
date -u +"end %F %T UTC"
# then, right after: one stream, tokenmill and llama.cpp alternating per precision, 3 rounds
PYTHONPATH=src .venv/bin/python benchmarks/wave3_peers.py --only a-pairs,report --out-dir results/wave3j
