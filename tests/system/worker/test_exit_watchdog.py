"""A worker stuck after SIGTERM still exits, with every thread's stack in its log.

A real process: the worker's `DrainingServer` whose drain blocks the event loop (so the drain's
own deadline can never fire), SIGTERM, and the exit watchdog must end it with status 1 and name
the stuck function on stderr.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, time, uvicorn
    import worker.server.main as worker_main

    worker_main.EXIT_WATCHDOG_S = 0.5

    async def app(scope, receive, send):
        pass

    async def stuck_drain():
        time.sleep(3600)  # blocks the event loop, as a hung native call would

    class Server(worker_main.DrainingServer):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            print("ready", flush=True)

    config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    Server(config, stuck_drain, 0.5).run()
    """
)


def test_a_worker_stuck_in_its_drain_exits_and_logs_where() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, stderr
    assert "stuck_drain" in stderr, stderr
