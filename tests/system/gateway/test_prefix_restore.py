"""Sessions that share a prefix, their worker SIGKILLed: restored elsewhere, they map the prefix
there (or insert it) and stay exact (issue #33, points 3 and 4).

Real processes on loopback: redis-server, two SmolLM2-135M workers (prefix cache on, the default)
and a gateway. Three sessions open with the same instructions and a few tokens of their own, then
take turns; the worker of the first is killed with SIGKILL between turns, and every session takes
more turns. What must hold: every output equals the same turns on an engine with the cache off
that was never interrupted, and the surviving worker's /metrics count prefix-cache hits.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import Any, Final

from redis.asyncio import Redis

from shared.client.clients import RealtimeClient
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.processes import http_get
from tests.system.gateway.conftest import GATEWAY_FLAGS, LINK_SECRET
from tests.system.gateway.stack import stop
from worker.engine import Engine

MODEL: Final = "smollm2-135m"
OUT = 3
CONFIG: Final[dict[str, Any]] = {"max_output_tokens": OUT, "stop_token_ids": []}
# 13 full pages of instructions and 4 tokens more, shared by every session.
INSTRUCTIONS = [(7919 * j) % 40000 + 100 for j in range(212)]
SESSIONS, TURNS, KILL_AFTER = 3, 4, 2
WORKER_FLAGS = [*LINK_SECRET, "--model", MODEL, "--kv-tokens", "4096", "--host-kv-tokens", "0"]
WORKER_FLAGS += ["--idle-timeout-s", "120", "--heartbeat-s", "0.5"]


def chunk(session: int, seq: int) -> list[int]:
    own = [3000 + 11 * session + 3 * seq + j for j in range(5)]
    return INSTRUCTIONS + own if seq == 1 else own


def reference() -> list[list[list[int]]]:
    """Each session's outputs on an engine with the cache off, never interrupted."""
    with Engine.load(MODEL, kv_tokens=4096, host_kv_tokens=0, prefix_cache="off") as engine:
        outputs = []
        for session in range(SESSIONS):
            sid = engine.open_session(stop_token_ids=(), max_output_tokens=OUT)
            outputs.append(
                [
                    list(engine.run_turn(sid, tokens=chunk(session, seq), seq=seq, timeout=120).tokens)
                    for seq in range(1, TURNS + 1)
                ]
            )
        return outputs


def hits(port: int) -> float:
    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    name = "microturn_worker_prefix_cache_hits_total "
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))


def test_sessions_sharing_a_prefix_restored_after_a_sigkill_stay_exact(servers: Servers) -> None:
    expected: list[list[list[int]]] = []
    computing = threading.Thread(target=lambda: expected.extend(reference()), daemon=True)
    computing.start()  # while the stack boots
    stack = servers.stack(workers=2, gateways=1, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS)
    schema = KeySchema(stack.prefix)

    async def body() -> tuple[list[list[list[int]]], str]:
        redis = Redis.from_url(stack.redis_url)
        clients = [await RealtimeClient.connect(stack.realtime_url(0)) for _ in range(SESSIONS)]
        try:
            sids = [(await client.open(**CONFIG)).session_id for client in clients]
            got: list[list[list[int]]] = [[] for _ in clients]
            for seq in range(1, KILL_AFTER + 1):
                for i, client in enumerate(clients):
                    got[i].append(list((await client.turn(seq, tokens=chunk(i, seq), timeout=120)).tokens))
            record = await read_session(redis, schema, sids[0])
            assert record is not None
            victim = record.worker
            stop(stack.workers[victim], signal.SIGKILL)
            for seq in range(KILL_AFTER + 1, TURNS + 1):
                for i, client in enumerate(clients):
                    got[i].append(list((await client.turn(seq, tokens=chunk(i, seq), timeout=120)).tokens))
            moved = await read_session(redis, schema, sids[0])
            assert moved is not None and moved.worker != victim
            return got, moved.worker
        finally:
            for client in clients:
                await client.disconnect()
            await redis.aclose()

    got, survivor = asyncio.run(asyncio.wait_for(body(), 600))
    computing.join(600)
    assert len(expected) == SESSIONS
    assert got == expected
    # The survivor mapped the shared instructions at least once: for a session that opened there
    # after another, or for a restored session after the first one rebuilt them.
    assert hits(stack.workers[survivor].port) >= 1
