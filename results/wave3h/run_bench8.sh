#!/bin/bash
# Eighth pass (AVX2 machine): every issue-20 row in one run, after the int4/attention/fast-path changes.
cd /work/main
date -u +"start %F %T UTC"
PYTHONPATH=src .venv/bin/python benchmarks/wave3_peers.py --only a-vllm-bf16,a-tm-bf16,a-tm-bf16-static,a-tm-int8,a-tm-int4,a-tm-bf16-compiled,a-tm-int8-compiled,a-tm-int4-compiled,a-llama-f16,a-llama-q8_0,a-llama-q4_0,report --out-dir results/wave3h
date -u +"end %F %T UTC"
