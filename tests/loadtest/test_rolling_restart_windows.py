"""`python -m loadtest.rolling_restart` says where its longest waits fell: in a drain, while a worker
restarted, or in neither (pure; no process), and reads the workers' lines apart."""

from pathlib import Path

from loadtest.rolling_restart import Run, _Stack, longest_by_window


def test_a_chunk_is_counted_in_the_window_its_wait_overlaps() -> None:
    run = Run("warm", sessions=1, history_tokens=0)
    run.events = [(3.0, "SIGTERM w0"), (3.5, "w0 exited; starting it again"), (6.0, "w0 ready")]
    run.waits = [
        (1.0, 40.0, 0),  # before the drain
        (2.95, 90.0, 0),  # sent before SIGTERM, answered in the drain
        (3.4, 200.0, 0),  # spans the drain's end and the restart: the drain's
        (5.0, 120.0, 0),  # while w0 boots
        (7.0, 60.0, 0),  # after
    ]
    assert longest_by_window(run) == {"drain": 200.0, "restart": 120.0, "serving": 60.0}


def test_a_run_without_restarts_has_only_serving_waits() -> None:
    run = Run("steady", sessions=1, history_tokens=0)
    run.waits = [(1.0, 40.0, 0), (2.0, 55.0, 0)]
    assert longest_by_window(run) == {"drain": 0.0, "restart": 0.0, "serving": 55.0}


def test_a_drains_copies_and_a_rebalances_moves_are_counted_apart(tmp_path: Path) -> None:
    """The workers' own log lines (worker/server/switchover.py, rebalance.py), as they print them."""
    (tmp_path / "worker-w0.log").write_text(
        "INFO worker.server.rebalance: rebalance: 4 of 4 session(s) moved to w1 in 256 ms "
        "(4 KV copied, 14.2 MB, 85.3 ms a session, 41 MB/s); 0 stay here\n"
        "INFO worker.server.switchover: drain: 3 session(s) switched to warm copies (3 placed; 5 chunks "
        "answered here while they warmed; 3 KV copied, 9.0 MB, 100.0 ms a session, 30 MB/s; 0 rebuilt "
        "from the log); 0 left for the classic handover\n"
    )
    stack = _Stack(tmp_path, "warm")
    stack.workers["w0"] = (None, 0)  # type: ignore[assignment]  # only its log is read
    run = Run("warm", sessions=7, history_tokens=0)
    stack.copy_figures(run)
    assert (run.copies, run.copy_mb, run.switched, run.placed, run.rebalanced) == (3, 9.0, 3, 3, 4)
