#!/usr/bin/env bash
# One short GPU check of tokenmill on a leased CUDA machine, from the repo root:
#
#     bash scripts/gpu_check.sh            # results under $OUT (default /tmp/gpu_check_out)
#
# Installs the wheels carried in .whl/ (packages the machine's image lacks) into /tmp/site,
# prints nvidia-smi and the versions, then runs benchmarks/gpu_check.py's stages (parity,
# throughput, serve), each in its own process under its own time limit, all inside one
# overall deadline (GPU_CHECK_DEADLINE_S, default 330 s), so a crash or a hang in one stage
# leaves the others' results. Writes $OUT/gpu_check.log, $OUT/result.json (every stage
# merged), $OUT/serve.log; per-stage JSON goes to $OUT/stages/.
#
# tokenmill's C++ CPU kernels are switched off (TOKENMILL_CPU_KERNELS=0): CUDA runs none of
# them, and a first build would cost minutes; gpu_check.py records any call that asks for them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-330}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
EXTRA=${GPU_CHECK_ARGS:-}
mkdir -p "$OUT/stages"
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
left() { echo $((DEADLINE_S - $(elapsed))); }
: >"$OUT/stages/stage_status.txt"

# run_stage NAME LIMIT_S COMMAND...: at most LIMIT_S, and never past the deadline.
run_stage() {
    local name=$1 limit=$2 rc
    shift 2
    if [ "$(left)" -lt "$limit" ]; then limit=$(left); fi
    if [ "$limit" -lt 15 ]; then
        echo "=== $name: skipped, $(left)s left before the deadline"
        echo "$name=skipped" >>"$OUT/stages/stage_status.txt"
        return
    fi
    echo "=== $name: start at $(elapsed)s, limit ${limit}s"
    timeout -k 5 "$limit" "$@"
    rc=$?
    echo "=== $name: rc=$rc at $(elapsed)s"
    echo "$name=$rc" >>"$OUT/stages/stage_status.txt"
}

main() {
    echo "=== wheels"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || echo "WHEEL INSTALL FAILED"
        # typing_extensions and anyio travel in .whl/opt: installed only where the image's are
        # older than pydantic/fastapi need (a second, shadowing copy otherwise).
        OPT=$(
            python3 - <<'EOF'
import glob
import re
from importlib.metadata import PackageNotFoundError, version


def key(v):
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


need = {"typing_extensions": "4.16.0", "anyio": "4.1.0"}
for name, minimum in need.items():
    try:
        have = version(name)
    except PackageNotFoundError:
        have = "0"
    if key(have) < key(minimum):
        print(*glob.glob(f".whl/opt/{name}-*.whl"))
EOF
        )
        if [ -n "$OPT" ]; then
            echo "image too old for: $OPT"
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site $OPT || echo "OPT WHEEL INSTALL FAILED"
        fi
    fi
    export PYTHONPATH=/tmp/site:$PWD/src
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TOKENMILL_CPU_KERNELS=0
    export TOKENMILL_CACHE=/tmp/gpu-cache TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
    echo "wheels done at $(elapsed)s"

    echo "=== nvidia-smi"
    timeout 20 nvidia-smi || echo "nvidia-smi failed"
    timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    uname -a
    nproc
    command -v c++ gcc ninja nvcc || true

    CHECK=(python3 benchmarks/gpu_check.py --device "$DEVICE" --out "$OUT/stages" --work /tmp/gpu_check_work)
    # shellcheck disable=SC2206
    CHECK+=($EXTRA)
    run_stage env 40 "${CHECK[@]}" --stage env
    run_stage parity 120 "${CHECK[@]}" --stage parity --budget-s 75
    run_stage throughput 150 "${CHECK[@]}" --stage throughput
    run_stage serve 60 "${CHECK[@]}" --stage serve --port 18517 --serve-wait-s 45
    mv -f "$OUT/stages/serve.log" "$OUT/serve.log" 2>/dev/null
    rm -f "$OUT"/stages/*.tmp # a stage killed mid-write (at most 8 files come back)
    DEADLINE_S=$((DEADLINE_S + 30))
    run_stage summary 25 "${CHECK[@]}" --stage summary
    mv -f "$OUT/stages/result.json" "$OUT/result.json" 2>/dev/null
    echo "=== done in $(elapsed)s"
}

main 2>&1 | tee "$OUT/gpu_check.log"
