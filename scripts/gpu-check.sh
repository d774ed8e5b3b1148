#!/usr/bin/env bash
# Everything the GPU issue measures, in one call on a lent GPU machine (the `device` tool):
#   1. install the carried wheels (.whl/: flashinfer-python, apache-tvm-ffi, gguf; the image has the rest),
#   2. run the CUDA tests (`pytest -m cuda`),
#   3. run `microturn bench` (streaming, reprefill, hf; 16 in, 8 out) on random bf16 weights shaped
#      like Llama-3.2-1B and Llama-3.1-8B, at 4 x 300 and at SGLang's CI shape 8 x 150,
#   4. run the capacity benchmark (`microturn bench --capacity`) on the first model,
#   5. measure the host KV tier's copies (`python -m loadtest.kv_copy`: offload and restore GB/s),
#   6. time the weight-only kernels of `--weights int4|int8` against bf16 F.linear per model step
#      (`python -m loadtest.weight_kernels`: SmolLM2, Llama-3.2-1B and Llama-3.1-8B shapes, M=1..512).
# Every report, log, JSON and plot goes into one archive, $OUT/gpu-check.tar.gz (the device tool
# brings back at most 8 files), beside $OUT/summary.txt (each bench's table and floor lines).
# Wheels, fetched here beforehand:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     flashinfer-python==0.7.2.post1 apache-tvm-ffi gguf
# then run this script through the device tool with carry [".whl"].
# A smoke run of the harness on a CPU (tiny model, small shapes, a short capacity step):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_DTYPE=float32 GPU_CHECK_MODELS=tiny GPU_CHECK_SHAPES=2x6 \
#     GPU_CHECK_CAPACITY_S=2 GPU_CHECK_KERNEL_ARGS="--models smoke --rows 1 --repeats 1 --rounds 1" \
#     PYTHON=.venv/bin/python OUT=/tmp/gpu-check scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=${GPU_CHECK_DTYPE:-bfloat16}
read -r -a MODELS <<<"${GPU_CHECK_MODELS:-llama-3.2-1b-shape llama-3.1-8b-shape}"
read -r -a SHAPES <<<"${GPU_CHECK_SHAPES-4x300 8x150}"  # sessions x turns; empty: no bench step
CAPACITY_S=${GPU_CHECK_CAPACITY_S:-20}                  # seconds per capacity step; 0: skip it
PYTHON=${PYTHON:-python3}
read -r -a KERNEL_ARGS <<<"${GPU_CHECK_KERNEL_ARGS:---repeats 10}"  # loadtest.weight_kernels' options
[ "${#MODELS[@]}" -gt 0 ] || { echo "GPU_CHECK_MODELS names no model" >&2; exit 2; }
RESULTS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PYTHON" -c "import torch; print('torch', torch.__version__, torch.version.cuda)"
    echo "command: $0 (device $DEVICE, dtype $DTYPE, models ${MODELS[*]}, shapes ${SHAPES[*]:-none})"
} | tee "$RESULTS/device.txt" "$OUT/summary.txt"

"$PYTHON" -m pytest -q -m cuda tests 2>&1 | tee "$RESULTS/gpu-tests.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 5 ] && status=0  # 5: no test is marked cuda; the log says so
tail -n 3 "$RESULTS/gpu-tests.log" >>"$OUT/summary.txt"

for model in "${MODELS[@]}"; do
    for shape in "${SHAPES[@]}"; do
        sessions=${shape%x*} turns=${shape#*x} name="bench-$model-$shape"
        "$PYTHON" -m microturn.main bench --model "$model" --device "$DEVICE" --dtype "$DTYPE" \
            --sessions "$sessions" --turns "$turns" --input-tokens 16 --output-tokens 8 \
            --modes streaming,reprefill,hf --json "$RESULTS/$name.json" --plot "$RESULTS/$name.png" \
            2>&1 | tee "$RESULTS/$name.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
        grep -v " INFO " "$RESULTS/$name.log" >>"$OUT/summary.txt"
    done
done

if [ "$CAPACITY_S" != 0 ]; then
    name="capacity-${MODELS[0]}"
    "$PYTHON" -m microturn.main bench --capacity --model "${MODELS[0]}" --device "$DEVICE" --dtype "$DTYPE" \
        --duration-s "$CAPACITY_S" --json "$RESULTS/$name.json" --plot "$RESULTS/$name.png" \
        --work-dir "$RESULTS/$name" 2>&1 | tee "$RESULTS/$name.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    grep -v " INFO " "$RESULTS/$name.log" | tail -n 25 >>"$OUT/summary.txt"
fi
"$PYTHON" -m loadtest.kv_copy --device "$DEVICE" --dtype "$DTYPE" --json "$RESULTS/kv-copy.json" \
    2>&1 | tee "$RESULTS/kv-copy.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$RESULTS/kv-copy.log" >>"$OUT/summary.txt"
"$PYTHON" -m loadtest.weight_kernels --device "$DEVICE" "${KERNEL_ARGS[@]}" --json "$RESULTS/weight-kernels.json" \
    2>&1 | tee "$RESULTS/weight-kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cat "$RESULTS/weight-kernels.log" >>"$OUT/summary.txt"
tar -czf "$OUT/gpu-check.tar.gz" -C "$RESULTS" .
exit "$status"
