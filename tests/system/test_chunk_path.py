"""docs/design.md's "The path of one chunk" is what the real stack executes: a measurement, kept
true, not a budget (a file budget rewarded merging two jobs into one file; what matters instead is
that the modules on the path form no import cycle, tests/test_architecture.py for the whole tree).

One measurement (tests/system/chunk_path.py: real redis-server, worker and gateway processes, about
10 s) serves every test of the module. When the path changes, the doc's tables are reprinted by
`python -m tests.system.chunk_path --markdown` (roles carried over, TODO for new files).
"""

from __future__ import annotations

import pytest

from tests.shared.redis_servers import ServerUnavailable
from tests.system.chunk_path import COMMAND, measure
from tests.system.path_cut import GROUPS, ChunkPath, order_events
from tests.system.path_doc import documented, documented_counts, markdown
from tests.test_architecture import REPO, cycles, in_fresh_process, module_name


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> ChunkPath:
    try:
        return measure(tmp_path_factory.mktemp("chunk-path"))
    except ServerUnavailable as exc:
        pytest.skip(str(exc))


def test_the_design_doc_lists_the_measured_path_in_order(measured: ChunkPath) -> None:
    tables = documented()
    for key, title in GROUPS.items():
        listed = [file for file, _role in tables.get(key, [])]
        assert listed == list(measured.group(key)), (
            f"docs/design.md '{title}' differs from the measurement; reprint it with `{COMMAND} --markdown`"
        )
    assert documented_counts() == (measured.path_files, measured.all_files)


def test_the_modules_on_the_path_import_no_cycle(measured: ChunkPath) -> None:
    project, _ = in_fresh_process()
    on_path = {module_name(REPO / file) for key in GROUPS for file in measured.group(key)}
    assert on_path <= set(project) and len(on_path) > 10
    graph = {name: edges & on_path for name, edges in project.items() if name in on_path}
    assert cycles(graph) == []


# ---- the tool's own logic, on hand-made events (no process) -------------------------------------


def test_events_before_the_frame_background_tasks_and_the_idle_sweep_are_left_out() -> None:
    engine = "microturn-engine"
    events = [
        [0.5, "gateway/old.py", "f", "MainThread", "", ""],  # before the send
        [1.1, "worker/engine/core.py", "EngineCore.expire_idle", engine, "", "sweep"],
        [1.2, "worker/server/heartbeat.py", "beat_once", "MainThread", "heartbeat_loop", ""],
        [1.3, "worker/engine/scheduler.py", "schedule", engine, "", "step"],  # before the frame came
        [1.4, "worker/server/link.py", "LinkConnection.serve", "MainThread", "serve", ""],
        [1.5, "worker/engine/core.py", "EngineCore.submit", engine, "", ""],
        [1.6, "worker/engine/core.py", "EngineCore.step", engine, "", "step"],
        [1.7, "worker/engine/model_runner.py", "ModelRunner.run", engine, "", "step"],
        [1.8, "worker/server/token_log.py", "TokenLogWriter.flush", "MainThread", "TokenLogWriter.run", ""],
        [1.9, "worker/server/link.py", "LinkConnection._write", "MainThread", "_write", ""],
    ]
    path = order_events(events, 1.0, "worker")
    assert path.files == ("worker/server/link.py", "worker/engine/core.py", "worker/engine/model_runner.py")
    assert path.step_only == {"worker/engine/model_runner.py"}
    assert path.functions["worker/engine/core.py"] == ("EngineCore.submit", "EngineCore.step")
    assert path.functions["worker/server/link.py"] == ("LinkConnection.serve", "LinkConnection._write")
    assert path.left_out == (
        "worker: TokenLogWriter.run: worker/server/token_log.py",
        "worker: heartbeat_loop: worker/server/heartbeat.py",
        "worker: sweep: worker/engine/core.py",
    )


def test_a_process_whose_loop_ran_nothing_after_the_send_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no event on its event loop"):
        order_events([[0.5, "gateway/app.py", "f", "MainThread", "", ""]], 1.0, "gateway")


def test_the_markdown_round_trips_through_the_doc_parser() -> None:
    path = ChunkPath(
        gateway=("gateway/a.py", "shared/s.py"),
        worker_path=("worker/b.py", "shared/s.py"),
        engine_step=("worker/c.py",),
        left_out=(),
    )
    doc = "# design\n\n## 10. The path of one chunk\n\n" + markdown(path, doc="") + "\n## 11. Next\n"
    assert documented_counts(doc) == (3, 4)  # shared/s.py counts once
    tables = documented(doc)
    assert {key: [file for file, _ in rows] for key, rows in tables.items()} == {
        "gateway": ["gateway/a.py", "shared/s.py"],
        "worker_path": ["worker/b.py", "shared/s.py"],
        "engine_step": ["worker/c.py"],
    }
    assert all(role == "TODO" for rows in tables.values() for _file, role in rows)
    with pytest.raises(ValueError, match="no section"):
        documented("# design\n\n## 1. Topology\n")
