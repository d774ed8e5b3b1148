"""From the two servers' event logs (tests/system/traced.py) to the files of one chunk's path.

The choices, and why:
- A process's path starts at the first event of its event-loop thread after the client sent the
  frame (for the gateway, the frame arriving; for the worker, the link frame arriving), on one
  clock: `time.monotonic()` is system-wide on Linux. It ends when the client holds `output.done`
  and the window closes, from the event loop, after what was ready to run: so the gateway's
  latency observation just after it wrote `output.done` is always in, never racing the client.
  Nothing else runs then: the client sends nothing more and the loops below are left out.
- Background loops are left out by their asyncio task, not by timing: the heartbeat
  (`heartbeat_loop`; the driver also sets its period to an hour) and the token-log flush
  (`TokenLogWriter.run`, which writes the turn to Redis FLUSH_INTERVAL_S after the reply went out:
  per-chunk work, but off the reply path). The engine thread's idle check (`EngineCore.expire_idle`)
  is left out by the frame it runs under. What was left out is kept, so nothing hides.
- A file is in the engine step when every one of its events runs under `EngineCore.step`
  (schedule -> run -> postprocess); a file that also runs outside the step (the engine core, which
  accepts the turn and runs the step) is on the path to and from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# The groups, in the order the report and the doc list them, with the doc's subsection headings.
GROUPS: Final = {
    "gateway": "Gateway",
    "worker_path": "Worker, to and from the engine step",
    "engine_step": "Worker, the engine step",
}
# Runs in every window (each `done` wakes it), so the driver checks the name still exists.
TOKEN_LOG_FLUSH_TASK: Final = "TokenLogWriter.run"
BACKGROUND_TASKS: Final = ("heartbeat_loop", TOKEN_LOG_FLUSH_TASK)
BACKGROUND_ROLES: Final = ("sweep",)


@dataclass(frozen=True)
class ChunkPath:
    """One measurement: each group's files in order of first execution, and what was left out."""

    gateway: tuple[str, ...]
    worker_path: tuple[str, ...]
    engine_step: tuple[str, ...]
    left_out: tuple[str, ...]  # "process: task or role: file", for the reader to check
    # process -> file -> the functions that ran, in order (`--functions`: what each file does)
    functions: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    def group(self, key: str) -> tuple[str, ...]:
        files: tuple[str, ...] = getattr(self, key)
        return files

    @property
    def path_files(self) -> int:
        """Distinct files from the client frame to the engine step and back, the step excluded."""
        return len({*self.gateway, *self.worker_path})

    @property
    def all_files(self) -> int:
        """Distinct files with the engine step."""
        return len({*self.gateway, *self.worker_path, *self.engine_step})


@dataclass(frozen=True)
class ProcessPath:
    """One process's share of the path."""

    files: tuple[str, ...]  # in order of first execution
    step_only: frozenset[str]  # those that ran only under EngineCore.step
    functions: dict[str, tuple[str, ...]]  # file -> its functions, in order of first execution
    left_out: tuple[str, ...]  # "process: task or role: file"


def order_events(events: Sequence[Sequence[Any]], t_send: float, name: str) -> ProcessPath:
    """Cut one process's log (tests/system/traced.py) to the chunk's path."""
    kept: list[tuple[float, str, str, str]] = []
    left_out: set[str] = set()
    for t, file, function, thread, task, role in events:
        if task in BACKGROUND_TASKS or role in BACKGROUND_ROLES:
            left_out.add(f"{name}: {task or role}: {file}")
        else:
            kept.append((t, file, function, "step" if role == "step" else thread))
    loop_events = [event[0] for event in kept if event[3] == "MainThread" and event[0] >= t_send]
    if not loop_events:
        raise RuntimeError(f"{name}: no event on its event loop after the chunk was sent")
    start = min(loop_events)
    functions: dict[str, list[str]] = {}
    outside_step: set[str] = set()
    for t, file, function, context in sorted(kept):
        if t < start:
            continue
        seen = functions.setdefault(file, [])
        if function not in seen:
            seen.append(function)
        if context != "step":
            outside_step.add(file)
    return ProcessPath(
        files=tuple(functions),
        step_only=frozenset(functions) - outside_step,
        functions={file: tuple(names) for file, names in functions.items()},
        left_out=tuple(sorted(left_out)),
    )
