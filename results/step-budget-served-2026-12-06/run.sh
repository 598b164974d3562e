#!/bin/bash
# serve SmolLM2 bf16 with a given --max-num-batched-tokens and run many + long
M=$1; OUT=/tmp/ttft/mnbt-$M-$2
.venv/bin/tokenmill serve $MODEL --port 8124 --max-model-len 2048 --max-num-seqs 32 --kv-cache-memory 1GiB --num-threads 2 --disable-access-log --max-num-batched-tokens $M > $OUT.log 2>&1 &
PID=$!
for i in $(seq 60); do curl -s localhost:8124/health >/dev/null && break; sleep 1; done
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8124 --dataset random --input-len 128 --output-len 64 --ignore-eos --num-prompts 32 --max-concurrency 16 --num-warmups 2 --no-progress --save-result $OUT-many.json --tokenizer $MODEL > /dev/null 2>&1
.venv/bin/tokenmill bench serve --base-url http://127.0.0.1:8124 --dataset random --input-len 1024 --output-len 64 --ignore-eos --num-prompts 16 --max-concurrency 8 --num-warmups 2 --no-progress --save-result $OUT-long.json --tokenizer $MODEL > /dev/null 2>&1
kill $PID; wait $PID 2>/dev/null
python3 -c "
import json
for w in ('many','long'):
    r=json.load(open('$OUT-'+w+'.json'))
    print('$M', w, round(r['output_throughput'],1), 'ttft', round(r['mean_ttft_ms']), 'p99ttft', round(r['p99_ttft_ms']), 'tpot', round(r['mean_tpot_ms'],1), 'p99itl', round(r['p99_itl_ms']))
"
