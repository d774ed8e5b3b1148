#!/usr/bin/env bash
# Everything the GPU issue measures, in one call on a lent GPU machine (the `device` tool):
#   1. install the carried wheels (.whl/: flashinfer-python, apache-tvm-ffi, gguf; the image has the rest),
#   2. run the CUDA tests,
#   3. run `microturn bench` (4 x 300, 16 in, 8 out; streaming, reprefill, hf) on random bf16 weights
#      shaped like Llama-3.1-8B and Llama-3.2-1B.
# Results land in $OUT (the device tool brings that folder back). Wheels, fetched here beforehand:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     flashinfer-python==0.7.2.post1 apache-tvm-ffi gguf
# then run this script through the device tool with carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } | tee "$OUT/device.txt"
python3 -m pytest -q -m cuda tests 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
for model in llama-3.2-1b-shape llama-3.1-8b-shape; do
    python3 -m shared.cli bench --model "$model" --device cuda --dtype bfloat16 \
        --modes streaming,reprefill,hf --json "$OUT/bench-$model.json" --plot "$OUT/bench-$model.png" \
        2>&1 | tee "$OUT/bench-$model.log"
done
exit "$status"
