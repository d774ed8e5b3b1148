"""`python -m loadtest.rolling_restart` says where its longest waits fell: in a drain, while a worker
restarted, or in neither (pure; no process)."""

from loadtest.rolling_restart import Run, longest_by_window


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
