#!/bin/bash
# one.sh NAME KIND [MNBT]: serve MODEL (default SmolLM2) bf16 with KIND vllm, tm (this tree) or ref (the tree
# at /tmp/ref-2b2, 2b275f8), then run many (32 x 128->64 @16) and long (16 x 1024->64 @8) with tokenmill bench.
NAME=$1; KIND=$2; MNBT=$3; OUT=/tmp/vm2/$NAME; MODEL=${MODEL:-~/.cache/tokenmill-real/smollm2-135m-instruct}; PORT=8613
cd /work/main
if [ $KIND = vllm ]; then
  EXTRA=""; [ -n "$MNBT" ] && EXTRA="--max-num-batched-tokens $MNBT"
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  ~/.cache/tokenmill-peers/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server --model $MODEL --port $PORT \
    --max-model-len 2048 --max-num-seqs 16 --dtype bfloat16 $EXTRA > $OUT.log 2>&1 &
else
  SRC=/work/main/src; [ $KIND = ref ] && SRC=/tmp/ref-2b2/src
  PYTHONPATH=$SRC .venv/bin/python -m tokenmill.entrypoints.cli serve $MODEL --port $PORT --max-model-len 2048 --max-num-seqs 16 --kv-cache-memory 1GiB --dtype bfloat16 --disable-access-log > $OUT.log 2>&1 &
fi
PID=$!
for i in $(seq 300); do curl -s localhost:$PORT/health >/dev/null && break; sleep 1; done
for w in "many 128 32 16"; do set -- $w
  .venv/bin/tokenmill bench serve --base-url http://127.0.0.1:$PORT --model $MODEL --dataset random --input-len $2 --output-len 64 --ignore-eos --num-prompts $3 --max-concurrency $4 --num-warmups 2 --no-progress --save-result $OUT-$1.json --tokenizer $MODEL > $OUT-$1.out 2>&1
done
kill $PID; wait $PID 2>/dev/null; sleep 2
python3 -c "
import json
for w in ('many',):
    r=json.load(open('$OUT-'+w+'.json'))
    print('$NAME', w, round(r['output_throughput'],1), 'ttft', round(r['mean_ttft_ms']), 'p99ttft', round(r['p99_ttft_ms']), 'tpot', round(r['mean_tpot_ms'],1), 'p99itl', round(r['p99_itl_ms']))
"
