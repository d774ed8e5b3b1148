"""The Locust load suite against a real stack (Valkey, a tiny worker, a gateway, all processes).

Locust runs exactly as a user runs it (`python -m locust -f loadtest/locustfile.py --headless ...`)
in its own process, so its gevent monkey-patching never enters pytest. No timing is asserted: what
is checked is that every chunk became a Locust request under the right name, none failed, and the
gateway's and the worker's `/metrics` counted the same chunks Locust did.
"""

from __future__ import annotations

import contextlib
import csv
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from loadtest.capacity.locust_run import LOCUSTFILE
from loadtest.capacity.metrics import ServerCounts, Snapshot, scrape, total
from loadtest.capacity.workload import CHUNK_NAME, REPLY_NAME
from tests.processes import REPO, Proc, microturn, worker_args
from tests.shared.redis_servers import running_server
from tests.wait import wait_until

USERS, RUN_S = 3, 4


class Stack(NamedTuple):
    gateway: Proc
    worker: Proc
    api_key: str
    # A gateway that allows fewer chunks per second than the users send: it refuses with
    # `rate_limited` and `retry_after_ms`.
    slow_gateway: Proc


SLOW_GATEWAY = ["--auth", "on", "--max-chunks-per-s", "2", "--chunk-burst", "1"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The gateway runs with auth on (its default), as a deployment would: Locust presents a key."""
    workdir = tmp_path_factory.mktemp("locust-stack")
    with (
        running_server("valkey", workdir) as redis_url,
        microturn("worker", worker_args(redis_url, "w-locust"), workdir) as worker,
        microturn("gateway", ["--redis-url", redis_url, "--auth", "on"], workdir) as gateway,
        microturn("gateway", ["--redis-url", redis_url, *SLOW_GATEWAY], workdir) as slow_gateway,
    ):
        yield Stack(gateway, worker, create_key(redis_url), slow_gateway)


def create_key(redis_url: str) -> str:
    """`microturn keys create` as an operator runs it: the key is the last line it prints."""
    argv = [
        sys.executable,
        "-m",
        "microturn",
        "keys",
        "create",
        "--redis-url",
        redis_url,
        "--name",
        "locust",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return done.stdout.strip().splitlines()[-1]


def locust_argv(host: str, api_key: str) -> list[str]:
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host]
    return [*argv, "--api-key", api_key]


def run_locust(
    stack: Stack, out: Path, *options: str, gateway: Proc | None = None
) -> tuple[dict[str, dict[str, Any]], str]:
    """Locust headless for RUN_S seconds; its final stats by request name, and its output."""
    argv = locust_argv((gateway or stack.gateway).ws, stack.api_key)
    argv += ["-u", str(USERS), "-r", str(USERS), "-t", f"{RUN_S}s", "--json-file", str(out / "stats")]
    argv += [*options]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    # Locust exits 1 when any request failed: the failures test expects exactly that.
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    entries = json.loads((out / "stats.json").read_text())
    return {entry["name"]: entry for entry in entries}, done.stdout + done.stderr


@pytest.mark.parametrize(
    "options",
    [
        pytest.param((), id="json-tokens"),
        pytest.param(
            ("--encoding", "msgpack", "--text", "the quick brown fox jumps", "--chunk-tokens", "3"),
            id="msgpack-text",
        ),
    ],
)
def test_every_chunk_is_a_request_without_failures(
    stack: Stack, tmp_path: Path, options: tuple[str, ...]
) -> None:
    gateway, worker, _key, _slow = stack
    before = Snapshot.take(gateway.http, worker.http)
    stats, output = run_locust(stack, tmp_path, *options)
    counts = ServerCounts.between(before, Snapshot.take(gateway.http, worker.http))

    # Chunks that ask for no output and chunks that ask for a reply are separate rows.
    assert set(stats) == {CHUNK_NAME, REPLY_NAME}, output[-3000:]
    chunks, replies = stats[CHUNK_NAME], stats[REPLY_NAME]
    assert chunks["num_failures"] == 0 and replies["num_failures"] == 0, output[-3000:]
    # 5 chunks/s for ~RUN_S s per user, one reply every 5th chunk.
    assert chunks["num_requests"] >= USERS * 5
    assert replies["num_requests"] >= USERS
    assert chunks["num_requests"] >= 3 * replies["num_requests"]
    assert sum(replies["response_times"].values()) == replies["num_requests"]
    # The servers saw what Locust saw, chunk for chunk.
    answered = chunks["num_requests"] + replies["num_requests"]
    assert counts.gateway_outputs == answered, counts
    assert counts.worker_turns == answered, counts
    assert counts.gateway_chunks == answered, counts
    assert counts.gateway_errors == 0, counts


def test_locust_reports_every_failure_with_its_error_code(stack: Stack, tmp_path: Path) -> None:
    """Chunks over the gateway's size limit come back as errors: each is a failure named by its code."""
    # The gateway refuses chunks of more than 512 tokens.
    stats, output = run_locust(stack, tmp_path, "--chunk-tokens", "600", "--csv", str(tmp_path / "run"))
    requests = sum(entry["num_requests"] for entry in stats.values())
    failures = sum(entry["num_failures"] for entry in stats.values())
    assert requests > 0 and failures == requests, output[-3000:]
    with (tmp_path / "run_failures.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows and all("chunk_too_large" in row["Error"] for row in rows), rows
    assert {row["Name"] for row in rows} <= {CHUNK_NAME, REPLY_NAME}


def test_refused_chunks_are_sent_again_after_retry_after_ms(stack: Stack, tmp_path: Path) -> None:
    """Users send 5 chunks/s to a gateway that takes 2: each refusal (`rate_limited`, with
    `retry_after_ms`) is resent once the pause is over, so none is a failure."""
    gateway, worker = stack.slow_gateway, stack.worker
    before = Snapshot.take(gateway.http, worker.http)
    stats, output = run_locust(stack, tmp_path, gateway=gateway)
    counts = ServerCounts.between(before, Snapshot.take(gateway.http, worker.http))
    assert sum(entry["num_failures"] for entry in stats.values()) == 0, output[-3000:]
    assert counts.gateway_errors > 0, counts  # refusals happened, and every one was retried
    answered = sum(entry["num_requests"] for entry in stats.values())
    assert answered >= USERS and counts.gateway_outputs == answered, (counts, output[-3000:])


class DroppingProxy:
    """A loopback TCP forwarder that can cut every connection through it at once: a network drop."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def drop(self) -> int:
        with self.lock:
            dropped, self.sockets = self.sockets, []
        for sock in dropped:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        return len(dropped) // 2

    def close(self) -> None:
        self.server.close()
        self.drop()


def test_users_resume_their_sessions_after_a_disconnect(stack: Stack, tmp_path: Path) -> None:
    gateway, worker, _key, _slow = stack
    proxy = DroppingProxy(gateway.port)
    try:
        before = Snapshot.take(gateway.http, worker.http)
        opened_before = http_metric(gateway, "microturn_gateway_sessions_opened_total")
        resumed_before = http_metric(gateway, "microturn_gateway_sessions_resumed_total")
        argv = locust_argv(f"ws://127.0.0.1:{proxy.port}", stack.api_key)
        argv += ["-u", str(USERS), "-r", str(USERS), "-t", "8s"]
        argv += ["--json-file", str(tmp_path / "stats")]
        outputs_before = http_metric(gateway, "microturn_gateway_outputs_total")
        with subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as run:

            def streaming() -> bool:
                """Every user is connected through the proxy, has its session and has been answered."""
                assert run.poll() is None, "locust ended before its users were dropped"
                return (
                    len(proxy.sockets) == 2 * USERS
                    and http_metric(gateway, "microturn_gateway_sessions_opened_total") - opened_before
                    == USERS
                    and http_metric(gateway, "microturn_gateway_outputs_total") - outputs_before >= 2 * USERS
                )

            wait_until(streaming, 60, f"{USERS} users streaming through the proxy")
            assert proxy.drop() == USERS
            output, _ = run.communicate(timeout=120)
        counts = ServerCounts.between(before, Snapshot.take(gateway.http, worker.http))
    finally:
        proxy.close()
    stats = {entry["name"]: entry for entry in json.loads((tmp_path / "stats.json").read_text())}
    assert sum(entry["num_failures"] for entry in stats.values()) == 0, output[-3000:]
    # The same sessions went on: resumed, never opened again.
    assert http_metric(gateway, "microturn_gateway_sessions_opened_total") - opened_before == USERS
    assert http_metric(gateway, "microturn_gateway_sessions_resumed_total") - resumed_before >= USERS
    answered = stats[CHUNK_NAME]["num_requests"] + stats[REPLY_NAME]["num_requests"]
    assert counts.gateway_outputs >= answered > USERS * 5, output[-3000:]


def http_metric(proc: Proc, name: str) -> float:
    return total(scrape(proc.http + "/metrics"), name)
