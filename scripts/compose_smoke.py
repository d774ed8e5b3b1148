"""The compose stack from the real image, without a daemon (#28); `scripts/compose-smoke.sh` runs it.

compose.yaml is read by Docker Compose's own parser (`docker-compose config`), never re-typed: every
service built from the Dockerfile runs with `buildah run` from the image, its command (after the
image's ENTRYPOINT, which `buildah run` ignores), its environment, in dependency order, each one
started once those it depends on pass their compose healthcheck. The services share one private
network namespace (the shell script makes it), so every service name resolves to 127.0.0.1 through
an /etc/hosts bound into each container, and the store the services name (Valkey in compose) is the
host's redis-server on the port their MT_REDIS_URL gives.

Then, from the host: an API key made by the image's own `keys create` (the command compose.yaml's
header gives users); the Python client and the OpenAI SDK each hold a session through the gateway,
replies exact against the engine fed the same tokens; each service's compose healthcheck and the
image's HEALTHCHECK pass inside the image; a worker's SIGTERM drains it and it exits 0. Then
everything stops, the containers are removed, and nothing is left running. Exit 0: all held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
from smoke_sessions import client_session, engine_outputs, openai_expected, openai_reference, openai_session

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the client and the engine, from this checkout

logger = logging.getLogger("compose-smoke")
BUILDAH = ["buildah", "--storage-driver", "vfs"]
RUN = [*BUILDAH, "run", "--isolation", "chroot"]
CHUNKS = 3  # Python client turns, of CHUNK_TOKENS tokens each
CHUNK_TOKENS = 8


@dataclass
class Service:
    name: str
    spec: dict[str, Any]
    container: str
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)


def duration_s(text: str | None, default: float) -> float:
    """A compose duration ("5s", "1m30s", "120s") in seconds."""
    if not text:
        return default
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", text))


def compose_services(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    binary = Path(sys.executable).parent / "docker-compose"
    done = subprocess.run(
        [str(binary), "-f", str(REPO / "compose.yaml"), "config", "--format", "json"],
        capture_output=True, text=True, check=True, cwd=REPO, env={**os.environ, **env},
    )  # fmt: skip
    return json.loads(done.stdout)["services"]  # type: ignore[no-any-return]


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        for dep in services[name].get("depends_on") or {}:
            visit(dep)
        if name not in order:
            order.append(name)

    for name in services:
        visit(name)
    return order


def image_config(image: str) -> dict[str, Any]:
    done = subprocess.run([*BUILDAH, "inspect", "--type", "image", image], capture_output=True, check=True)
    return json.loads(done.stdout)["Docker"]["config"]  # type: ignore[no-any-return]


def run_in(service: Service, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`argv` inside `service`'s container, with its environment and the shared /etc/hosts."""
    return subprocess.run(
        [*RUN, *container_flags(service), service.container, "--", *argv],
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip


HOSTS_FILE = Path("/tmp") / f"compose-smoke-hosts-{os.getpid()}"


def container_flags(service: Service) -> list[str]:
    flags = ["--no-hosts", "-v", f"{HOSTS_FILE}:/etc/hosts:ro"]
    for key, value in service.env.items():
        flags += ["--env", f"{key}={value}"]
    return flags


def healthcheck(service: Service, test: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    kind, *argv = test
    if kind == "CMD-SHELL":
        argv = ["/bin/sh", "-c", argv[0]]
    assert kind in ("CMD", "CMD-SHELL"), f"{service.name}: healthcheck {test[0]!r} is not a command"
    return run_in(service, argv, timeout_s)


def wait_healthy(service: Service) -> float:
    """Poll the service's compose healthcheck until it passes (its start period and retries bound it)."""
    check = service.spec["healthcheck"]
    interval = duration_s(check.get("interval"), 30.0)
    deadline = (
        time.monotonic() + duration_s(check.get("start_period"), 0.0) + interval * check.get("retries", 3)
    )
    started = time.monotonic()
    while True:
        assert service.popen is not None
        if service.popen.poll() is not None:
            raise SystemExit(
                f"{service.name} exited {service.popen.returncode} while starting (see {service.log})"
            )
        done = healthcheck(service, check["test"], duration_s(check.get("timeout"), 30.0) + 30)
        if done.returncode == 0:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise SystemExit(f"{service.name}: healthcheck never passed: {done.stderr[-400:]}")
        time.sleep(min(interval, 1.0))


def microturn_pid(service: Service) -> int:
    """The service's own process (compose's PID 1 in its container), below `buildah run`.

    `buildah run` does not forward SIGTERM (its chroot runtime dies and takes the command with it),
    and its `buildah-chroot-exec` carries the command's arguments too: the one wanted is below it.
    """
    assert service.popen is not None
    for child in psutil.Process(service.popen.pid).children(recursive=True):
        cmdline = child.cmdline()
        if cmdline and cmdline[0].startswith("buildah"):
            continue
        if any(arg.endswith("/microturn") for arg in cmdline) and service.spec["command"][0] in cmdline:
            return int(child.pid)
    raise SystemExit(f"{service.name}: no microturn process found under buildah run")


def stop(service: Service, grace_s: float) -> tuple[int, float]:
    """SIGTERM the service's process, as `docker compose stop` does; its exit status and stop time."""
    assert service.popen is not None
    started = time.monotonic()
    os.kill(microturn_pid(service), signal.SIGTERM)
    try:
        status = service.popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        service.popen.kill()
        raise SystemExit(f"{service.name} did not stop within its {grace_s:g} s grace period") from None
    return status, time.monotonic() - started


def keys_create(services: dict[str, Service], entrypoint: list[str]) -> str:
    """The key from compose.yaml's own `docker compose run --rm SERVICE keys create ...` line."""
    header = (REPO / "compose.yaml").read_text()
    match = re.search(r"^#\s+docker compose run --rm (\S+) (keys create .+)$", header, re.MULTILINE)
    assert match, "compose.yaml's header gives no `keys create` command"
    service, args = services[match[1]], shlex.split(match[2])
    done = run_in(service, [*entrypoint, *args], 120)
    assert done.returncode == 0, f"keys create failed: {done.stderr[-600:]}"
    logger.info(
        "`%s %s` in %s: %s", " ".join(entrypoint), match[2], service.name, done.stdout.splitlines()[0]
    )
    return done.stdout.strip().splitlines()[-1]


def flag(command: list[str], name: str) -> str:
    """One `--name=value` of a compose command (the worker's model, for the reference)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(f"--{name}")
    return str(getattr(parser.parse_known_args(command[1:])[0], name.replace("-", "_")))


def still_running() -> list[psutil.Process]:
    """What the smoke started and did not stop: in its own PID namespace, every process but this
    one and its parents; elsewhere, this one's descendants."""
    if os.environ.get("COMPOSE_SMOKE_PIDNS") != "1":
        return list(psutil.Process().children(recursive=True))
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    return [p for p in psutil.process_iter() if p.pid not in mine]


def start_service(service: Service, image: str, entrypoint: list[str]) -> None:
    subprocess.run([*BUILDAH, "rm", service.container], capture_output=True, check=False)
    started = time.monotonic()
    made = [*BUILDAH, "from", "--pull=never", "--name", service.container, image]
    subprocess.run(made, capture_output=True, check=True)
    logger.info(
        "%s: container %s made in %.0f s", service.name, service.container, time.monotonic() - started
    )
    command = service.spec["command"]
    argv = [*RUN, *container_flags(service), service.container, "--", *entrypoint, *command]
    service.popen = subprocess.Popen(argv, stdout=service.log.open("wb"), stderr=subprocess.STDOUT)
    logger.info("%s: %s %s", service.name, " ".join(entrypoint), shlex.join(command))
    logger.info("%s: compose healthcheck passed after %.1f s", service.name, wait_healthy(service))


def check_images_healthcheck(services: dict[str, Service], image: str) -> list[str]:
    """Each container runs as the image's user, and the image's own HEALTHCHECK passes in each."""
    failures = []
    test = image_config(image)["Healthcheck"]["Test"]
    for service in services.values():
        user = run_in(service, ["id", "-un"], 60).stdout.strip()
        own = healthcheck(service, test, 60)
        logger.info("%s: runs as %s; the image's HEALTHCHECK: exit %d", service.name, user, own.returncode)
        if own.returncode != 0 or user != "microturn":
            failures.append(f"{service.name}: user {user}, the image's HEALTHCHECK exit {own.returncode}")
    return failures


def check_sessions(port: int, key: str, model: str, reference: subprocess.Popen[str]) -> list[str]:
    """The Python client and the OpenAI SDK through the gateway, each against the engine alone."""
    failures = []
    rng = random.Random(28)
    chunks = [[rng.randrange(1000, 40000) for _ in range(CHUNK_TOKENS)] for _ in range(CHUNKS)]
    got = asyncio.run(client_session(f"ws://127.0.0.1:{port}/v1/realtime", key, chunks))
    want = engine_outputs(model, chunks)
    logger.info("Python client: %s; engine alone: %s", got, want)
    if got != want:
        failures.append("the Python client's replies differ from the engine's")
    texts = asyncio.run(openai_session(f"http://127.0.0.1:{port}/v1", key, model))
    expected = openai_expected(reference)
    logger.info("OpenAI SDK: %s; engine alone: %s", texts, expected)
    if texts != expected:
        failures.append("the OpenAI SDK's replies differ from the engine's")
    return failures


def check_gpu_extra(worker: Service, entrypoint: list[str]) -> list[str]:
    """In an image with the `gpu` extra (EXTRAS=gpu): flashinfer imports on this CUDA-less machine,
    and `--attention flashinfer` on the CPU runs the start-up self-check against torch, which
    refuses (exit 2, saying why) rather than crash: the CUDA kernels run only on a GPU
    (scripts/gpu-check.sh). Images without the extra: nothing to check."""
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('flashinfer') is None)"
    if run_in(worker, ["python", "-c", probe], 60).returncode != 0:
        return []
    versions = (
        "import flashinfer, torch; print(flashinfer.__version__, torch.__version__, torch.version.cuda)"
    )
    imported = run_in(worker, ["python", "-c", versions], 300)
    logger.info("%s: flashinfer, torch, CUDA: %s", worker.name, (imported.stdout or imported.stderr).strip())
    # The worker's own command and environment, on a port of its own, asked for flashinfer on the CPU.
    command = [*worker.spec["command"], "--attention=flashinfer", "--device=cpu", "--port=8199"]
    refused = run_in(worker, [*entrypoint, *command], 300)
    reason = [
        line for line in refused.stdout.splitlines() + refused.stderr.splitlines() if "cannot serve" in line
    ]
    logger.info(
        "%s --attention=flashinfer --device=cpu: exit %d: %s", worker.name, refused.returncode, reason
    )
    failures = [] if imported.returncode == 0 else [f"flashinfer does not import: {imported.stderr[-400:]}"]
    if refused.returncode != 2 or not reason:
        failures.append(f"the self-check on the CPU did not refuse cleanly: exit {refused.returncode}")
    return failures


def check_drain(worker: Service) -> list[str]:
    status, took = stop(worker, duration_s(worker.spec.get("stop_grace_period"), 10.0))
    drained = "draining worker" in worker.log.read_text(errors="replace")
    logger.info("%s: SIGTERM -> exit %d after %.1f s (drained: %s)", worker.name, status, took, drained)
    return (
        [] if status == 0 and drained else [f"{worker.name}: SIGTERM gave exit {status}, drained: {drained}"]
    )


def stop_everything(services: dict[str, Service], store: subprocess.Popen[bytes]) -> list[str]:
    for service in reversed(list(services.values())):
        if service.popen is not None and service.popen.poll() is None:
            # Exit status only reported: the gateway stops by the SIGTERM uvicorn re-raises.
            status, took = stop(service, duration_s(service.spec.get("stop_grace_period"), 10.0))
            logger.info("%s: SIGTERM -> exit %d after %.1f s", service.name, status, took)
    store.terminate()
    store.wait(30)
    for service in services.values():
        subprocess.run([*BUILDAH, "rm", service.container], capture_output=True, check=False)
    HOSTS_FILE.unlink(missing_ok=True)
    left = [p.cmdline() for p in still_running()]
    listed = [*BUILDAH, "containers", "--format", "{{.ContainerName}}"]
    names = subprocess.run(listed, capture_output=True, text=True, check=True).stdout.split()
    leftover = [name for name in names if name.startswith("compose-smoke-")]
    logger.info("after the stop: %d processes, containers: %s", len(left), leftover or "none")
    return [f"left running: {left} {leftover}"] if left or leftover else []


def read_compose(out: Path) -> tuple[dict[str, Any], dict[str, Service], list[str]]:
    """compose.yaml's services (a fresh link secret through its interpolation), the microturn ones
    in start order, and the rest (played by the host)."""
    secret = f"smoke-{random.getrandbits(64):x}"
    specs = compose_services({"MT_LINK_SECRET": secret})
    built = [name for name in start_order(specs) if "build" in specs[name]]
    services = {}
    for name in built:
        env = {key: str(value) for key, value in (specs[name].get("environment") or {}).items()}
        assert env.get("MT_LINK_SECRET") == secret, f"{name}: the link secret is not compose's"
        services[name] = Service(name, specs[name], f"compose-smoke-{name}", out / f"{name}.log", env=env)
    return specs, services, [name for name in specs if name not in built]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--image", default="microturn:latest")
    parser.add_argument("--out", default=str(REPO / "smoke-out"), help="service logs go here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("worker").setLevel(logging.WARNING)  # the reference engine's start-up lines
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs, services, others = read_compose(out)
    logger.info(
        "compose.yaml: %s from %s with buildah run; %s from the host", list(services), args.image, others
    )
    HOSTS_FILE.write_text("127.0.0.1 localhost " + " ".join(specs) + "\n")
    by_command = {service.spec["command"][0]: service for service in services.values()}
    worker, gateway = by_command["worker"], by_command["gateway"]
    redis_url = urlparse(worker.env["MT_REDIS_URL"])
    assert redis_url.hostname in others, f"MT_REDIS_URL names {redis_url.hostname}, not a compose service"
    store = subprocess.Popen(
        ["redis-server", "--port", str(redis_url.port or 6379), "--bind", "127.0.0.1", "--save", ""],
        stdout=(out / "redis.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    model = flag(worker.spec["command"], "model")
    reference = openai_reference(model)
    entrypoint = image_config(args.image)["Entrypoint"]  # `buildah run` ignores it: given here
    failures: list[str] = []
    try:
        for service in services.values():
            start_service(service, args.image, entrypoint)
        failures += check_images_healthcheck(services, args.image)
        key = keys_create(services, entrypoint)
        port = int(next(p["published"] for p in gateway.spec["ports"]))
        failures += check_sessions(port, key, model, reference)
        failures += check_gpu_extra(worker, entrypoint)
        failures += check_drain(worker)
    finally:
        reference.kill()
        failures += stop_everything(services, store)
    for failure in failures:
        logger.error("FAILED: %s", failure)
    logger.info("compose smoke: %s", "FAILED" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
