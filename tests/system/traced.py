"""Run a Python module under a recorder of which project files execute, between two signals.

    python -m tests.system.traced microturn.main worker --port 8100 ...

The wrapped process runs as usual (`runpy`, as `python -m` would), with a profile hook installed
before anything starts, in the main thread and in every thread started later (the worker's engine
thread, `asyncio.to_thread` workers). The hook returns at once until SIGUSR1 opens a window;
inside it, every call (or coroutine resume: CPython reports both as `call`) of code in shared/,
gateway/ or worker/ is logged when its function or context differs from the thread's previous logged event,
so the log holds each change of function or context, not each call. SIGUSR2 closes the window and writes
the log as JSON to `$CHUNK_PATH_OUT/<pid>.json` (from the event loop, once what was ready to run
has run); SIGUSR1 acknowledges by writing `<pid>.started`.

Each event is `[t, file, function, thread, task, role]` (`function`: the code's qualified name):
- `t`: `time.monotonic()`, which on Linux is one clock for every process, so the driver can cut
  the window at the instants its client sent the frame and received the answer;
- `task`: the qualified name of the coroutine of the running asyncio task, or "" outside a task
  (an engine-thread call, a loop callback), so background loops can be told apart from the chunk;
- `role`: "step" when a frame of `EngineCore.step` is on the stack (the engine step), "sweep" under
  `EngineCore.expire_idle` (the engine thread's idle check), else "".

Nothing here is imported by the project: the hook is installed from outside, so production code
carries no tracing.
"""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[2]
PACKAGES: Final = ("shared", "gateway", "worker")
OUT_ENV: Final = "CHUNK_PATH_OUT"
# Functions whose frame on the stack gives a call its role (the qualified name of the code object).
ROLE_MARKERS: Final = {"EngineCore.step": "step", "EngineCore.expire_idle": "sweep"}
_STACK_LIMIT: Final = 64

Event = tuple[float, str, str, str, str, str]


class Recorder:
    """The profile hook and its log. Only the signal handlers (main thread) flip `active`."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.active = False
        self.events: list[Event] = []
        # Per thread: the last logged (code, task, role), so a run of calls in one function logs once.
        self._last: dict[int, tuple[CodeType, str, str]] = {}
        # code object -> project-relative path, or "" for code outside the project (the common case).
        self._files: dict[CodeType, str] = {}
        self._prefixes = tuple(str(REPO / package) + os.sep for package in PACKAGES)
        self._root_len = len(str(REPO)) + 1

    def _file_of(self, code: CodeType) -> str:
        name = self._files.get(code)
        if name is None:
            path = code.co_filename
            name = path[self._root_len :] if path.startswith(self._prefixes) else ""
            self._files[code] = name
        return name

    def hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if not self.active or event != "call":
            return
        name = self._file_of(frame.f_code)
        if not name:
            return
        role = ""
        outer: FrameType | None = frame
        for _ in range(_STACK_LIMIT):
            if outer is None:
                break
            marker = ROLE_MARKERS.get(outer.f_code.co_qualname)
            if marker is not None:
                role = marker
                break
            outer = outer.f_back
        task = ""
        loop = asyncio._get_running_loop()
        if loop is not None:
            current = asyncio.current_task(loop)
            if current is not None:
                task = getattr(current.get_coro(), "__qualname__", "")
        thread = threading.current_thread()
        key = (frame.f_code, task, role)
        if self._last.get(thread.ident or 0) != key:
            self._last[thread.ident or 0] = key
            logged = (time.monotonic(), name, frame.f_code.co_qualname, thread.name, task, role)
            self.events.append(logged)

    def start(self, _signum: int, _frame: FrameType | None) -> None:
        self.events = []
        self._last = {}
        self.active = True
        (self.out_dir / f"{os.getpid()}.started").write_text("")

    def stop(self, _signum: int, _frame: FrameType | None) -> None:
        # The handler may run in the middle of a task's step (between two bytecodes). Closing the
        # window from the event loop instead, behind what is ready to run, lets that step and
        # the callbacks already queued finish first: the gateway's writer task observes a chunk's
        # latency just after writing its `output.done`, and that belongs to the chunk.
        loop = asyncio._get_running_loop()
        if loop is None:
            self._dump()
        else:
            loop.call_soon_threadsafe(loop.call_soon, self._dump)

    def _dump(self) -> None:
        self.active = False
        target = self.out_dir / f"{os.getpid()}.json"
        partial = target.with_suffix(".partial")
        partial.write_text(json.dumps(self.events))
        partial.rename(target)  # the driver never reads a half-written log


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tests.system.traced <module> [args...]")
    recorder = Recorder(Path(os.environ[OUT_ENV]))
    signal.signal(signal.SIGUSR1, recorder.start)
    signal.signal(signal.SIGUSR2, recorder.stop)
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
