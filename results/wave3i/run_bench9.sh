#!/bin/bash
# Ninth pass (AVX2 machine): tokenmill against llama.cpp in one run, after the memory and start-up changes (vLLM not rerun).
cd /work/main
date -u +"start %F %T UTC"
PYTHONPATH=src .venv/bin/python benchmarks/wave3_peers.py --only a-tm-bf16,a-llama-f16,a-tm-int8,a-llama-q8_0,a-tm-int4,a-llama-q4_0,a-tm-int8-compiled,report --out-dir results/wave3i
date -u +"end %F %T UTC"
