#!/bin/bash
# tokenmill against vLLM CPU and llama.cpp on the 250M benchmark Llama, one server at a time,
# as docs/benchmarks.md reports it (2-vCPU AMD EPYC, AVX2 only). Run from the repository root.
date -u +"start %F %T UTC"
PYTHONPATH=src .venv/bin/python benchmarks/peers_run.py --only a-tm-bf16,a-llama-f16,a-tm-int8,a-llama-q8_0,a-tm-int4,a-llama-q4_0,a-vllm-bf16,a-tm-bf16-static,a-tm-bf16-static-lat,report --out-dir results/peers-250m-avx2-2026-12-03
date -u +"end %F %T UTC"
# then, right after: one stream, tokenmill and llama.cpp alternating per precision, 3 rounds
PYTHONPATH=src .venv/bin/python benchmarks/peers_run.py --only a-pairs,report --out-dir results/peers-250m-avx2-2026-12-03
