"""`microturn up` as a real subprocess for end-to-end tests: started on free ports, always stopped.

Why a helper of its own: the e2e tests check the command a user runs, not the pieces, so they start
`python -m microturn up` exactly as `make up` would, with an embedded Valkey. The helper records
the children `up` started so a test can prove none of them outlives it, and its teardown kills
whatever is left (only those recorded processes) even when the test failed half way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.processes import REPO as ROOT
from tests.shared.redis_servers import free_port

# Loading SmolLM2 on a busy CPU runner can take a while; the stack reports its own failures sooner.
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    port: int
    worker_port: int
    log: Path
    children: list[psutil.Process] = field(default_factory=list)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def record_children(self) -> list[psutil.Process]:
        """The processes `up` runs now (Valkey, worker, gateway); also kept in `children`."""
        found: list[psutil.Process] = psutil.Process(self.proc.pid).children(recursive=True)
        known = {p.pid for p in self.children}
        self.children += [p for p in found if p.pid not in known]
        return found

    def child(self, needle: str) -> psutil.Process:
        for proc in self.children:
            if needle in " ".join(proc.cmdline()):
                return proc
        raise LookupError(f"no child of up runs {needle!r}: {[p.cmdline() for p in self.children]}")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_ready(up: Up, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _ready(up.http + "/readyz"):
        if up.proc.poll() is not None:
            raise RuntimeError(f"up exited with {up.proc.returncode}:\n{up.output()[-4000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"up not ready after {timeout_s} s:\n{up.output()[-4000:]}")
        time.sleep(0.2)


def gone(procs: list[psutil.Process], timeout_s: float = 10.0) -> list[psutil.Process]:
    """The processes still alive after `timeout_s` (an empty list when all are gone)."""
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def kill_leftovers(up: Up) -> None:
    """Stop `up` if it still runs, then kill any process it started that is still there."""
    if up.proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            up.record_children()
        up.proc.send_signal(signal.SIGTERM)
        try:
            up.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            up.proc.wait()
    for proc in up.children:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():
                proc.kill()
    psutil.wait_procs(up.children, timeout=10)


def launch(workdir: Path, *args: str) -> Up:
    """Start `python -m microturn up --port <free> --worker-port <free> *args`; do not wait."""
    port, worker_port = free_port(), free_port()
    log = workdir / f"up-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MT_")}  # embedded Valkey, defaults
    env["PYTHONUNBUFFERED"] = "1"
    argv = [
        sys.executable,
        "-m",
        "microturn",
        "up",
        "--port",
        str(port),
        "--worker-port",
        str(worker_port),
    ]
    with log.open("wb") as sink:
        proc = subprocess.Popen([*argv, *args], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env)
    return Up(proc, port, worker_port, log)


@contextlib.contextmanager
def running_up(workdir: Path, *args: str) -> Iterator[Up]:
    """`up` started by `launch`, ready when the gateway is; stopped (and checked for leftovers) at exit."""
    up = launch(workdir, *args)
    try:
        wait_ready(up)
        up.record_children()
        yield up
    finally:
        kill_leftovers(up)
