"""Real microturn processes for integration tests: started on free ports, stopped at teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.shared.redis_servers import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Process:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def wait_ready(process: Process, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.proc.poll() is not None:
            raise RuntimeError(
                f"{process.name} exited with {process.proc.returncode}:\n{process.output()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(process.http + "/readyz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{process.name} not ready after {timeout_s} s:\n{process.output()[-3000:]}")


def stop(process: Process, timeout_s: float = 15.0) -> None:
    if process.proc.poll() is None:
        process.proc.send_signal(signal.SIGTERM)
        try:
            process.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.proc.kill()
            process.proc.wait()


@contextlib.contextmanager
def microturn(kind: str, args: list[str], workdir: Path, name: str | None = None) -> Iterator[Process]:
    """`python -m shared.cli <kind> --port <free> <args>`, ready when `/readyz` answers 200."""
    port = free_port()
    label = name or f"{kind}-{port}"
    log = workdir / f"{label}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", kind, "--port", str(port), *args],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
        )
    process = Process(label, port, proc, log)
    try:
        wait_ready(process)
        yield process
    finally:
        stop(process)


def worker_args(redis_url: str, worker_id: str, *extra: str) -> list[str]:
    return [
        "--model",
        "tiny",
        "--redis-url",
        redis_url,
        "--worker-id",
        worker_id,
        "--kv-tokens",
        "8192",
        *extra,
    ]
