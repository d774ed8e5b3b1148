#!/usr/bin/env bash
# Build the microturn image from the Dockerfile as it is: with Docker when a daemon answers, else
# with Debian's buildah (no daemon, no registry needed), and print the image's size and build time.
#
#   scripts/image-build.sh          # CPU image, microturn:latest   (make image)
#   scripts/image-build.sh --gpu    # GPU variant, microturn:gpu: EXTRAS=gpu, CUDA torch (make image-gpu)
#
# Environment:
#   IMAGE        the tag to build (default microturn:latest, or microturn:gpu with --gpu)
#   TORCH_INDEX  where torch comes from; default: the Dockerfile's (or compose.gpu.yaml's) PyTorch
#                index if it answers, else pip's configured index-url, else PyPI (whose torch
#                2.13.0 is the CUDA build: it runs on CPUs too, in a bigger image)
#   BUILDER      docker or buildah (default: docker if `docker info` answers, else buildah)
#   REBUILD_BASE 1: remake the base image even if one is there (buildah path)
#
# The buildah path (Debian's buildah 1.28, root): `buildah bud --isolation chroot --storage-driver
# vfs`, which needs no daemon, no overlay mounts and no user namespaces. When no registry gives
# python:3.11-slim, the base is made by mmdebstrap (Debian bookworm: python3 3.11, pip) and
# committed under the name the FROM line asks for. Either way, the host's extra CA certificates
# (/usr/local/share/ca-certificates, e.g. a network that re-signs TLS) go into the base before
# pip runs. vfs copies whole layers: a build needs about 20 GB free while it runs.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=cpu
case "${1:-}" in
    "") ;;
    --gpu) VARIANT=gpu ;;
    *) echo "usage: $0 [--gpu]" >&2; exit 2 ;;
esac
if [ "$VARIANT" = gpu ]; then
    IMAGE=${IMAGE:-microturn:gpu}
    EXTRAS=gpu
    # The overlay's own build args: what `docker compose -f compose.yaml -f compose.gpu.yaml build` uses.
    DEFAULT_INDEX=$(sed -n 's/^ *TORCH_INDEX: *//p' compose.gpu.yaml)
else
    IMAGE=${IMAGE:-microturn:latest}
    EXTRAS=
    DEFAULT_INDEX=$(sed -n 's/^ARG TORCH_INDEX=//p' Dockerfile)
fi
BASE=python:3.11-slim # the Dockerfile's FROM
[ "$(sed -n 's/^FROM //p' Dockerfile)" = "$BASE" ] || { echo "the Dockerfile's FROM is not $BASE" >&2; exit 2; }
CA_DIR=/usr/local/share/ca-certificates
STORAGE=(--storage-driver vfs)
log() { printf '%s image-build: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        log "needs root for: $*"; exit 1
    fi
}

# Debian's packages only: buildah and mmdebstrap (and curl for the index probe).
need_packages() {
    local missing=()
    for pair in "$@"; do command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}"); done
    [ "${#missing[@]}" -eq 0 ] && return
    log "installing ${missing[*]} (apt)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2 \
        || { as_root apt-get update -q >&2 && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2; }
}

choose_index() {
    if [ -n "${TORCH_INDEX:-}" ]; then echo "$TORCH_INDEX"; return; fi
    if curl -fsS -m 10 -o /dev/null "${DEFAULT_INDEX%/}/torch/" 2>/dev/null; then echo "$DEFAULT_INDEX"; return; fi
    local configured
    configured=$(pip config get global.index-url 2>/dev/null || true)
    echo "${configured:-https://pypi.org/simple}"
}

extra_certs() { compgen -G "$CA_DIR/*.crt" || true; }

# The base for buildah: the registry's python:3.11-slim if one answers, else Debian bookworm by
# mmdebstrap. Committed as docker.io/library/python:3.11-slim, which `FROM python:3.11-slim` finds.
make_base_buildah() {
    local name=docker.io/library/$BASE ctr
    if [ "${REBUILD_BASE:-0}" != 1 ] && buildah "${STORAGE[@]}" inspect --type image "$name" >/dev/null 2>&1; then
        log "base $name is there (REBUILD_BASE=1 remakes it)"
        return
    fi
    buildah "${STORAGE[@]}" rmi -f "$name" >/dev/null 2>&1 || true
    if timeout 120 buildah "${STORAGE[@]}" pull -q "$name" >/dev/null 2>&1; then
        log "base: pulled $name"
        ctr=$(buildah "${STORAGE[@]}" from --pull=never "$name")
        if [ -n "$(extra_certs)" ]; then
            buildah "${STORAGE[@]}" copy "$ctr" "$CA_DIR"/ "$CA_DIR"/
            buildah "${STORAGE[@]}" run --isolation chroot "$ctr" -- update-ca-certificates >&2
            # The official image's pip trusts its own certifi bundle, not the system's.
            buildah "${STORAGE[@]}" config --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$ctr"
        fi
    else
        log "base: no registry gives $name; making it with mmdebstrap (Debian bookworm)"
        local tarball
        tarball=$(mktemp --suffix=.tar)
        # python-is-python3: `python` (compose.yaml's healthchecks); passwd: useradd (the Dockerfile).
        # EXTERNALLY-MANAGED goes: the official image has none, and the Dockerfile pip-installs as root.
        as_root mmdebstrap --variant=minbase --quiet \
            --include=python3,python3-pip,python-is-python3,ca-certificates,passwd \
            --customize-hook='for crt in '"$CA_DIR"'/*.crt; do [ -e "$crt" ] && cp "$crt" "$1'"$CA_DIR"'/"; done; true' \
            --customize-hook='chroot "$1" update-ca-certificates' \
            --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
            --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
            bookworm "$tarball" >&2
        ctr=$(buildah "${STORAGE[@]}" from scratch)
        buildah "${STORAGE[@]}" add "$ctr" "$tarball" / >/dev/null
        rm -f "$tarball"
        buildah "${STORAGE[@]}" config --env LANG=C.UTF-8 \
            --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --cmd python3 --label org.microturn.base=mmdebstrap-bookworm "$ctr"
    fi
    buildah "${STORAGE[@]}" commit -q --rm "$ctr" "$name" >/dev/null
    log "base committed as $name"
}

build_buildah() {
    need_packages buildah:buildah mmdebstrap:mmdebstrap
    local base_start=$SECONDS
    make_base_buildah
    log "base ready in $((SECONDS - base_start)) s"
    # docker format: the OCI format has no HEALTHCHECK, buildah would drop it. No --layers: one
    # container for the whole build and one commit at the end (vfs stores every layer in full).
    nice -n 10 buildah "${STORAGE[@]}" bud --isolation chroot --pull=never --format docker \
        --build-arg "TORCH_INDEX=$INDEX" --build-arg "EXTRAS=$EXTRAS" -f Dockerfile -t "$IMAGE" . >&2
    # What bud left behind: the previous image of this tag, now untagged.
    buildah "${STORAGE[@]}" rmi --prune >/dev/null 2>&1 || true
    SIZE=$(buildah "${STORAGE[@]}" images --format '{{.Size}}' "$IMAGE" | head -n 1)
}

build_docker() {
    local base=$BASE
    if [ -n "$(extra_certs)" ]; then
        # The same certificates on the official base, under a tag of its own, given to FROM by name.
        base=microturn-base:python-3.11-slim
        local context
        context=$(mktemp -d)
        cp "$CA_DIR"/*.crt "$context"/
        printf 'FROM %s\nCOPY *.crt %s/\nRUN update-ca-certificates\nENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt\n' \
            "$BASE" "$CA_DIR" >"$context/Dockerfile"
        docker build -q -t "$base" "$context" >&2
        rm -rf "$context"
    fi
    nice -n 10 docker buildx build --load --build-context "$BASE=docker-image://$base" \
        --build-arg "TORCH_INDEX=$INDEX" --build-arg "EXTRAS=$EXTRAS" -f Dockerfile -t "$IMAGE" . >&2
    SIZE=$(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')
}

need_packages curl:curl
if [ -z "${BUILDER:-}" ]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then BUILDER=docker; else BUILDER=buildah; fi
fi
INDEX=$(choose_index)
log "building $IMAGE ($VARIANT) with $BUILDER; torch from $INDEX"
start=$SECONDS
"build_$BUILDER"
elapsed=$((SECONDS - start))
log "built $IMAGE"
printf 'image %s (%s, %s): size %s, build time %dm%02ds\n' "$IMAGE" "$VARIANT" "$BUILDER" "$SIZE" \
    $((elapsed / 60)) $((elapsed % 60))
