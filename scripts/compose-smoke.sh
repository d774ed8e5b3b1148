#!/usr/bin/env bash
# Run the stack compose.yaml describes from the built image, and check it from the host (#28):
#
#   scripts/compose-smoke.sh              # the image scripts/image-build.sh made (make compose-smoke)
#   IMAGE=microturn:gpu scripts/compose-smoke.sh
#
# With a Docker daemon: `docker compose up --wait`, the same checks' first half (every service
# healthy), then `docker compose down`. Without one (this project's machines): scripts/compose_smoke.py
# runs every microturn service of compose.yaml with `buildah run`, the store from Debian's
# redis-server, all in a private network and PID namespace (unshare), so the compose ports (6379,
# 8000, 8100) never meet another stack on the machine, and nothing outlives the run: when it ends,
# the kernel ends whatever is still in the namespace. Needs root (buildah, unshare) and the
# checkout's .venv (`make install`: the client, the OpenAI SDK, the engine for the reference,
# Docker Compose's parser). Service logs go to smoke-out/. Exit 0: every check held.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-microturn:latest}
PY=${PY:-.venv/bin/python}

if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    trap 'docker compose down --timeout 30' EXIT
    MT_LINK_SECRET=${MT_LINK_SECRET:-smoke-$RANDOM$RANDOM} docker compose up --wait --wait-timeout 300
    docker compose run --rm gateway keys create --name smoke --max-sessions 10 | tail -n 1
    exit 0
fi

[ "$(id -u)" = 0 ] || { echo "compose-smoke: buildah and unshare need root" >&2; exit 1; }
missing=()
command -v buildah >/dev/null || missing+=(buildah)
command -v redis-server >/dev/null || missing+=(redis-server)
command -v ip >/dev/null || missing+=(iproute2)
if [ "${#missing[@]}" -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi
[ -x "$PY" ] || { echo "compose-smoke: no $PY (run make install)" >&2; exit 1; }
buildah --storage-driver vfs inspect --type image "$IMAGE" >/dev/null 2>&1 \
    || { echo "compose-smoke: no image $IMAGE (run make image)" >&2; exit 1; }
# A new network namespace has only a loopback, down: bring it up, then run the smoke inside.
# The shell stays PID 1 (it reaps); COMPOSE_SMOKE_PIDNS tells the smoke every other process is its own.
exec unshare --net --pid --fork --mount-proc \
    bash -c 'ip link set lo up && COMPOSE_SMOKE_PIDNS=1 "$0" scripts/compose_smoke.py --image "$1"' "$PY" "$IMAGE"
