"""`placement`: the prefix-cache hit rate of two workers, with and without prefix-aware placement.

A stack of processes (Valkey, two `tiny` workers, a gateway) is started afresh for each side.
`sessions` sessions of two applications, each with its own `instructions`-token instructions, open
in a random (seeded) order and stay open; each sends one chunk of its own. With the preference, a
session names its instructions in its open (`keep_prefix_text`), so placement can prefer a worker
that holds them (shared/store/lua/place.lua); without, it sends them as the start of its first
chunk (the same tokens: `tiny` tokenizes byte by byte), so only the load rule places it. Opens are
`pause_s` apart, past a heartbeat, so the registry has caught up. Figure: hits / (hits + misses)
over both workers' /metrics, and how many workers each application's sessions landed on.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from microturn.processes import Child, free_port, http_ready, redis_answers, spawn, valkey_binary
from shared.client import SyncRealtimeClient

HEARTBEAT_S = 0.3
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PlacementConfig:
    sessions: int = 24
    instructions: int = 1024
    own: int = 32
    pause_s: float = 3 * HEARTBEAT_S
    seed: int = 33


def _wait(ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready")
        time.sleep(0.1)


class _TwoWorkers:
    """Valkey, two `tiny` workers and a gateway, as processes under `workdir` (their logs there)."""

    def __init__(self, workdir: Path, kv_tokens: int) -> None:
        self.workdir = workdir
        self.kv_tokens = kv_tokens
        self.children: list[Child] = []
        self.worker_ports: list[int] = []
        self.gateway_port = 0

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.children.append(spawn(name, argv, 15.0, (self.workdir / f"{name}.log").open("ab")))

    def start(self) -> None:
        port = free_port()
        self._spawn("valkey", [str(valkey_binary()), "--port", str(port), "--save", "", "--appendonly", "no"])
        _wait(lambda: redis_answers("127.0.0.1", port), "valkey")
        redis_url = f"redis://127.0.0.1:{port}/0"
        for i in range(2):
            worker_port = free_port()
            argv = [
                sys.executable,
                "-m",
                "microturn",
                "worker",
                "--model",
                "tiny",
                "--port",
                str(worker_port),
            ]
            argv += ["--redis-url", redis_url, "--worker-id", f"w{i}", "--kv-tokens", str(self.kv_tokens)]
            argv += ["--host-kv-tokens", "0", "--max-chunk-tokens", "2048", "--max-queued-tokens", "2048"]
            argv += ["--heartbeat-s", str(HEARTBEAT_S)]
            self._spawn(f"worker-{i}", argv)
            self.worker_ports.append(worker_port)
        # The gateway boots beside the workers (it needs only Valkey): the stack is up in about its
        # slowest process's time, not the sum.
        self.gateway_port = free_port()
        argv = [sys.executable, "-m", "microturn", "gateway", "--port", str(self.gateway_port)]
        argv += ["--redis-url", redis_url, "--auth", "off", "--max-chunk-tokens", "2048"]
        self._spawn("gateway", argv)
        for worker_port in self.worker_ports:
            _wait(lambda p=worker_port: http_ready(f"http://127.0.0.1:{p}/readyz"), "worker")  # type: ignore[misc]
        _wait(lambda: http_ready(f"http://127.0.0.1:{self.gateway_port}/readyz"), "gateway")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


def _metric(port: int, name: str) -> float:
    from urllib.request import urlopen

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def _app_text(app: int, length: int) -> str:
    sentence = f"Application {app}: you answer questions about product line {app}, briefly and kindly. "
    return (sentence * (length // len(sentence) + 1))[:length]


def _side(config: PlacementConfig, preferred: bool) -> dict[str, Any]:
    order = [i % 2 for i in range(config.sessions)]
    random.Random(config.seed).shuffle(order)
    apps = [_app_text(app, config.instructions) for app in (0, 1)]
    kv_tokens = 4 * (config.sessions * (config.own + 64) + 2 * config.instructions)
    with tempfile.TemporaryDirectory(prefix="prefix-placement-") as work:
        stack = _TwoWorkers(Path(work), kv_tokens)
        try:
            stack.start()
            url = f"ws://127.0.0.1:{stack.gateway_port}/v1/realtime"
            clients = []
            for i, app in enumerate(order):
                client = SyncRealtimeClient.connect(url)
                own = f" Session {i:04d} asks about item {i * 7 % 100:02d}."[: config.own]
                if preferred:
                    client.open(keep_prefix_text=apps[app], stop_token_ids=[], max_output_tokens=2)
                    client.turn(1, text=own, max_output_tokens=2, flush=True, timeout=600)
                else:
                    client.open(stop_token_ids=[], max_output_tokens=2)
                    client.turn(1, text=apps[app] + own, max_output_tokens=2, flush=True, timeout=600)
                clients.append(client)
                time.sleep(config.pause_s)
            hits = sum(_metric(p, "microturn_worker_prefix_cache_hits_total") for p in stack.worker_ports)
            misses = sum(_metric(p, "microturn_worker_prefix_cache_misses_total") for p in stack.worker_ports)
            held = [_metric(p, "microturn_worker_prefix_cache_cached_pages") for p in stack.worker_ports]
            for client in clients:
                client.close()
        finally:
            stack.stop()
    return {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses),
        "cached_pages_per_worker": held,
    }


def run_placement(config: PlacementConfig) -> dict[str, Any]:
    preferred = _side(config, preferred=True)
    load_only = _side(config, preferred=False)
    return {
        "sessions": config.sessions,
        "instructions_tokens": config.instructions,
        "with_preference": preferred,
        "without_preference": load_only,
    }
