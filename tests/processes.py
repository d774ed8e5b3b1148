"""Real microturn processes for integration tests: started on free ports, stopped at teardown.

Every process is a supervised child (microturn/processes.py, as `microturn up` runs them) with a free
port and a log file, waited for on its `/readyz`; a process that exits at start (its port was taken)
is retried on another port, and `stop` sends the signal, then SIGKILL, so nothing leaks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from microturn.processes import Child, free_port, http_ready, spawn

logger = logging.getLogger(__name__)

REPO: Final = Path(__file__).resolve().parents[1]
# A start is given this long while it lives: SmolLM2 workers booting three at once on a loaded
# 2-core machine (load ~12) were not ready in 60 s, and a slow start retried on another port only
# loads the same model again (the worst case is the same 3 x 60 s it was).
_READY_TIMEOUT_S: Final = 180.0
_STOP_TIMEOUT_S: Final = 10.0
_PORT_ATTEMPTS: Final = 3


@dataclass
class Proc:
    """A supervised child (microturn/processes.py) on a known port, with its log file."""

    name: str
    port: int
    args: list[str]
    log_path: Path
    child: Child
    tls: bool = False  # serves https and wss (a gateway given --tls-cert-file)

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        return self.child.proc

    @property
    def http(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.child.alive

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


# Four servers and the tests share a couple of cores: one torch thread per worker avoids
# oversubscription (and is how the engine runs best on a small CPU anyway).
_ENV: Final = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
}


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _wait_ready(proc: Proc, timeout: float) -> bool:
    """True once /readyz answers; False if the process exited (its port may have been taken: the
    caller tries another); RuntimeError if it still lives, not ready, after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        if http_ready(proc.http + "/readyz"):
            return True
        time.sleep(0.1)
    raise RuntimeError(f"{proc.name} was not ready after {timeout:g} s:\n{proc.log_tail()}")


def stop(proc: Proc, sig: int = signal.SIGTERM) -> None:
    """`sig`, then SIGKILL if the process is still there after the stop timeout."""
    proc.child.stop(sig)


def start(name: str, command: str, flags: list[str], log_dir: Path, *, tls: bool = False) -> Proc:
    """Start `python -m microturn <command> --host 127.0.0.1 --port <free> <flags>`, wait for /readyz
    (over https for a process that serves TLS: `tls`); a process that exits before it is ready is
    started again on another port."""
    for attempt in range(_PORT_ATTEMPTS):
        port = free_port()
        args = [sys.executable, "-m", "microturn", command, "--host", "127.0.0.1", "--port", str(port)]
        args += flags
        log_path = log_dir / f"{name}-{port}.log"
        with open(log_path, "wb") as log:
            child = spawn(name, args, _STOP_TIMEOUT_S, log, env=_ENV, cwd=REPO, die_with_parent=False)
        proc = Proc(name, port, args, log_path, child, tls)
        try:
            if _wait_ready(proc, _READY_TIMEOUT_S):
                logger.info("%s up on port %d", name, port)
                return proc
        except BaseException:
            stop(proc, signal.SIGKILL)
            raise
        logger.warning("%s failed on port %d (attempt %d):\n%s", name, port, attempt + 1, proc.log_tail())
        stop(proc, signal.SIGKILL)
    raise RuntimeError(f"{name} did not become ready; logs in {log_dir}")


@contextlib.contextmanager
def microturn(kind: str, args: list[str], workdir: Path, name: str | None = None) -> Iterator[Proc]:
    """`python -m microturn <kind> --port <free> <args>`, ready when `/readyz` answers 200."""
    process = start(name or kind, kind, args, workdir)
    try:
        yield process
    finally:
        stop(process)


def run_to_exit(command: str, *flags: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`microturn COMMAND FLAGS...` run until it exits by itself (a start it refuses), its output kept."""
    return subprocess.run(
        [sys.executable, "-m", "microturn", command, *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )


def worker_args(redis_url: str, worker_id: str, *extra: str) -> list[str]:
    base = ["--model", "tiny", "--redis-url", redis_url, "--worker-id", worker_id, "--kv-tokens", "8192"]
    return [*base, *extra]
