cd /work/main
for m in gemma3-270m smollm2-135m-instruct; do
 for flags in "--dtype bfloat16" "--quantization int8" "--quantization int4"; do
  for tree in /tmp/old-tree/src src; do
   echo "== $m $flags $tree"
   PYTHONPATH=$tree timeout 300 .venv/bin/python benchmarks/serve_rss.py --model ~/.cache/tokenmill-real/$m --only single $flags 2>&1 | grep -E 'ready|peak|single'
  done
 done
done
