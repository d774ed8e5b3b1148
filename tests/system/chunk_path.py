"""Measure which project files one steady-state chunk executes, client frame to `output.done`.

    .venv/bin/python -m tests.system.chunk_path             # the measured list, grouped by process
    .venv/bin/python -m tests.system.chunk_path --markdown  # the same as docs/design.md's tables
    .venv/bin/python -m tests.system.chunk_path --functions # and the functions each file ran

It starts the real stack on loopback (redis-server on a free port, one worker with the `tiny` model
on CPU, one gateway with `--auth off`), each server under `tests.system.traced`. A client opens a
session and sends a few warm-up chunks (imports and first-call paths are done then);
then both servers open their recording window (SIGUSR1), the client sends one token chunk asking for
a few output tokens and waits for its `output.done`, and the windows close (SIGUSR2).

What counts as the chunk's path, and why: tests/system/path_cut.py. The doc's format:
tests/system/path_doc.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from microturn.processes import spawn
from tests.processes import REPO, Proc, http_get, stop
from tests.shared.redis_servers import free_port, running_server
from tests.system.path_cut import GROUPS, TOKEN_LOG_FLUSH_TASK, ChunkPath, order_events
from tests.system.path_doc import markdown
from tests.system.traced import OUT_ENV

COMMAND: Final = "python -m tests.system.chunk_path"
WARMUP_CHUNKS: Final = 4
CHUNK_TOKENS: Final = (11, 12, 13, 14, 15, 16, 17, 18)
OUTPUT_TOKENS: Final = 4
_READY_TIMEOUT_S: Final = 60.0
_SIGNAL_TIMEOUT_S: Final = 10.0
_STOP_TIMEOUT_S: Final = 10.0
# An hour: no heartbeat and no idle expiry comes near the window.
QUIET_FLAGS: Final = ["--idle-timeout-s", "3600"]
QUIET_WORKER_FLAGS: Final = ["--heartbeat-s", "3600"]


@dataclass
class _Traced:
    proc: Proc
    out_dir: Path

    def signal_and_wait(self, signum: int, suffix: str) -> Path:
        target = self.out_dir / f"{self.proc.popen.pid}{suffix}"
        target.unlink(missing_ok=True)
        self.proc.popen.send_signal(signum)
        deadline = time.monotonic() + _SIGNAL_TIMEOUT_S
        while not target.exists():
            if time.monotonic() > deadline or not self.proc.alive():
                raise RuntimeError(
                    f"{self.proc.name} did not answer signal {signum}:\n{self.proc.log_tail()}"
                )
            time.sleep(0.01)
        return target


@contextlib.contextmanager
def _traced(name: str, command: str, flags: list[str], workdir: Path) -> Iterator[_Traced]:
    port = free_port()
    args = [sys.executable, "-m", "tests.system.traced", "microturn.main", command]
    args += ["--host", "127.0.0.1", "--port", str(port), *flags]
    env = {"OMP_NUM_THREADS": "1", OUT_ENV: str(workdir)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        child = spawn(name, args, _STOP_TIMEOUT_S, log, env=env, cwd=REPO, die_with_parent=False)
    proc = Proc(name, port, args, log_path, child)
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not _ready(proc):
            if time.monotonic() > deadline or not proc.alive():
                raise RuntimeError(f"{name} did not become ready:\n{proc.log_tail()}")
            time.sleep(0.1)
        yield _Traced(proc, workdir)
    finally:
        stop(proc, signal.SIGKILL)


def _ready(proc: Proc) -> bool:
    with contextlib.suppress(OSError):
        return http_get(proc.http + "/readyz", timeout=1.0)[0] == 200
    return False


def _request(ws: ClientConnection, message: dict[str, Any], answer: str) -> dict[str, Any]:
    ws.send(json.dumps(message))
    while True:
        reply: dict[str, Any] = json.loads(ws.recv(timeout=30))
        if reply["type"] == answer:
            return reply
        if reply["type"] == "error":
            raise RuntimeError(f"{message['type']} refused: {reply}")


def _chunk(seq: int) -> dict[str, Any]:
    return {
        "type": "input.chunk",
        "seq": seq,
        "tokens": list(CHUNK_TOKENS),
        "max_output_tokens": OUTPUT_TOKENS,
    }


def measure(workdir: Path) -> ChunkPath:
    """Run the stack, trace one steady-state chunk, return its path."""
    with contextlib.ExitStack() as exits:
        redis_url = exits.enter_context(running_server("redis", workdir))
        common = ["--redis-url", redis_url, "--key-prefix", "chunkpath", *QUIET_FLAGS]
        worker_flags = [*common, *QUIET_WORKER_FLAGS, "--model", "tiny", "--worker-id", "w0"]
        worker_flags += ["--kv-tokens", "4096"]
        worker = exits.enter_context(_traced("worker", "worker", worker_flags, workdir))
        gateway = exits.enter_context(_traced("gateway", "gateway", [*common, "--auth", "off"], workdir))
        # The native protocol is named: a socket offering no microturn subprotocol speaks OpenAI's.
        offer = [Subprotocol("microturn.v1.json")]
        ws = exits.enter_context(
            connect(f"{gateway.proc.ws}/v1/realtime", subprotocols=offer, open_timeout=30)
        )
        # stop_token_ids []: the reply is always OUTPUT_TOKENS long, never cut by a sampled EOS.
        _request(ws, {"type": "session.open", "config": {"stop_token_ids": []}}, "session.opened")
        for seq in range(WARMUP_CHUNKS):
            _request(ws, _chunk(seq), "output.done")
        servers = {"gateway": gateway, "worker": worker}
        for server in servers.values():
            server.signal_and_wait(signal.SIGUSR1, ".started")
        t_send = time.monotonic()
        done = _request(ws, _chunk(WARMUP_CHUNKS), "output.done")
        if len(done["tokens"]) != OUTPUT_TOKENS:
            raise RuntimeError(f"the traced chunk got {done['tokens']}, not {OUTPUT_TOKENS} tokens")
        logs = {name: server.signal_and_wait(signal.SIGUSR2, ".json") for name, server in servers.items()}
    events = {name: json.loads(log.read_text()) for name, log in logs.items()}
    # The names the cut relies on must still exist: a rename would silently change the lists.
    seen = {(task, role) for *_head, task, role in events["worker"]}
    if not any(role == "step" for _task, role in seen):
        raise RuntimeError("no worker event ran under EngineCore.step: update ROLE_MARKERS (traced.py)")
    if not any(task == TOKEN_LOG_FLUSH_TASK for task, _role in seen):
        raise RuntimeError(f"no event of the task {TOKEN_LOG_FLUSH_TASK}: update path_cut.py")
    on_gateway = order_events(events["gateway"], t_send, "gateway")
    on_worker = order_events(events["worker"], t_send, "worker")
    return ChunkPath(
        gateway=on_gateway.files,
        worker_path=tuple(file for file in on_worker.files if file not in on_worker.step_only),
        engine_step=tuple(file for file in on_worker.files if file in on_worker.step_only),
        left_out=on_gateway.left_out + on_worker.left_out,
        functions={"gateway": on_gateway.functions, "worker": on_worker.functions},
    )


def report(path: ChunkPath, *, functions: bool = False) -> str:
    lines: list[str] = []
    for key, title in GROUPS.items():
        files = path.group(key)
        ran = path.functions.get("gateway" if key == "gateway" else "worker", {})
        lines.append(f"{title}: {len(files)} files")
        for i, file in enumerate(files, 1):
            lines.append(f"  {i:2}. {file}")
            if functions:
                lines += [f"        {name}" for name in ran.get(file, ())]
    lines.append(f"distinct files from the client frame to the engine step and back: {path.path_files}")
    lines.append(f"distinct files with the engine step: {path.all_files}")
    lines.append("left out (background, see the module docstring):")
    lines += [f"  {line}" for line in path.left_out] or ["  nothing"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--markdown", action="store_true", help="print docs/design.md's tables")
    parser.add_argument("--functions", action="store_true", help="under each file, the functions that ran")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="chunk-path-") as workdir:
        path = measure(Path(workdir))
    if args.markdown:
        print(markdown(path))
    else:
        print(report(path, functions=args.functions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
