"""A command that starts an engine refuses what it cannot serve: exit 2, the reason, no traceback
(worker/engine/engine.py, `START_REFUSALS`); so does a server whose port is taken. The worker's
other cases are with what they refuse (tests/worker/test_weight_forms.py, test_attention_selection.py)."""

from __future__ import annotations

import socket

from redis import Redis

from shared.settings import EXIT_REFUSED
from tests.conftest import Servers
from tests.processes import run_to_exit, worker_args


def test_chat_with_a_model_that_is_not_there_says_so_and_exits_2() -> None:
    done = run_to_exit("chat", "--model", "/nonexistent/model.gguf")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "microturn chat: error: model '/nonexistent/model.gguf' is neither a preset" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_whose_port_is_taken_refuses_before_it_loads_or_registers(servers: Servers) -> None:
    # Before, it loaded its model and registered in Redis, and only then failed to bind (uvicorn's
    # exit, 3 here): gateways could pick the entry meanwhile.
    redis_url = servers.redis()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_to_exit(
            "worker", *worker_args(redis_url, "w-taken", "--host", "127.0.0.1", "--port", str(port))
        )
    assert done.returncode == EXIT_REFUSED, done.stderr[-2000:]
    assert (
        f"the worker does not start: cannot listen on 127.0.0.1 port {port}: Address already in use"
        in done.stderr
    )
    assert "Traceback" not in done.stderr
    assert "model tiny ready" not in done.stderr  # refused before the model loads
    assert Redis.from_url(redis_url).keys("*") == []  # and never registered


def test_a_gateway_whose_port_is_taken_says_so_and_exits_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_to_exit("gateway", "--host", "127.0.0.1", "--port", str(port), "--auth", "off")
    assert done.returncode == EXIT_REFUSED, done.stderr[-2000:]
    refusal = f"gateway not started: cannot listen on 127.0.0.1 port {port}: Address already in use"
    assert refusal in done.stderr
    assert "Traceback" not in done.stderr
