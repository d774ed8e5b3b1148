"""The stack on a Redis Cluster (`--redis-mode cluster`), and over TLS with a password in both modes.

A real cluster of six redis-server nodes (tests/shared/redis_cluster.py): sessions are opened,
streamed and resumed across two gateways with every output checked against the engine alone, their
keys spread over the masters with each session's two keys on one; the keys CLI works against it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from shared.client.clients import RealtimeClient
from shared.protocol.messages import SessionClosed
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.system.gateway.conftest import GATEWAY_FLAGS, SMALL_SEEDS, SMALL_TURNS, WORKER_FLAGS
from tests.system.gateway.reference import SESSION_CONFIG, PendingReferences, stream

CLUSTER = ["--redis-mode", "cluster"]
TURNS = 6


async def turns(client: RealtimeClient, seed: int, first: int, last: int, expected: list[list[int]]) -> None:
    chunks = stream(seed, last)
    for seq in range(first, last + 1):
        done = await client.turn(seq, tokens=chunks[seq - 1])
        assert list(done.tokens) == expected[seq - 1], f"stream {seed} turn {seq}"


def test_sessions_open_stream_and_resume_across_gateways_on_a_cluster(
    servers: Servers, references: PendingReferences
) -> None:
    cluster = servers.redis_cluster()
    stack = servers.stack(
        cluster.url, worker_flags=[*WORKER_FLAGS, *CLUSTER], gateway_flags=[*GATEWAY_FLAGS, *CLUSTER]
    )
    schema = KeySchema(stack.prefix)
    seeds = [*SMALL_SEEDS][:4]
    expected = {seed: references.get(seed, SMALL_TURNS) for seed in seeds}

    async def body() -> list[str]:
        sids = []
        for seed in seeds:
            first = await RealtimeClient.connect(stack.realtime_url(0), "msgpack")
            opened = await first.open(**SESSION_CONFIG)
            await turns(first, seed, 1, TURNS, expected[seed])
            await first.disconnect()
            second = await RealtimeClient.connect(stack.realtime_url(1), "json")
            resumed = await second.resume(opened.session_id, opened.resume_token, last_seq=TURNS)
            assert resumed.last_seq == TURNS
            await turns(second, seed, TURNS + 1, SMALL_TURNS, expected[seed])
            sids.append(opened.session_id)
            if seed == seeds[-1]:
                assert await second.close() == SessionClosed("closed")
            else:
                await second.disconnect()
        return sids

    sids = asyncio.run(asyncio.wait_for(body(), 180))
    for sid in sids:
        assert cluster.master_of(schema.log(sid)) == cluster.master_of(schema.session(sid))
    # Each session's keys share a slot of their own: the hash tag is the session, not the prefix
    # (one slot for all four would be 1 in 16,384**3 by chance). Not their masters: four sessions
    # land on one master of three once in 27 runs.
    slots = {key_slot(schema.session(sid).encode()) for sid in sids}
    assert {key_slot(schema.log(sid).encode()) for sid in sids} == slots and len(slots) > 1, slots

    async def records() -> list[bool]:
        client = RedisCluster.from_url(cluster.url)
        try:
            return [bool(await client.exists(schema.session(sid))) for sid in sids]
        finally:
            await client.aclose()

    assert asyncio.run(records()) == [True, True, True, False]  # the closed one is gone


def test_the_keys_cli_works_against_a_cluster(servers: Servers) -> None:
    cluster = servers.redis_cluster()
    common = ["--redis-url", cluster.url, "--redis-mode", "cluster", "--key-prefix", "tkeys"]

    def keys(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "microturn", "keys", *args, *common],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    secret = keys("create", "--name", "alpha").strip().splitlines()[-1]
    assert len(secret) > 20
    listed = keys("list")
    assert "alpha" in listed and secret not in listed
    assert "revoked key 'alpha'" in keys("revoke", "alpha")
    assert "alpha" not in keys("list")


@pytest.mark.parametrize("mode", ["standalone", "cluster"])
def test_tls_and_a_password_in_the_url_reach_every_process(
    servers: Servers, references: PendingReferences, mode: str
) -> None:
    """rediss:// with a password (and the CA to trust) in the URL, in both modes."""
    if mode == "cluster":
        url = servers.redis_cluster(tls=True).url
    else:
        url = servers.redis("redis", password="s3cret-pw", tls=True)
    assert url.startswith("rediss://:") and "@127.0.0.1" in url
    flags = ["--redis-mode", mode]
    stack = servers.stack(
        url,
        worker_flags=[*WORKER_FLAGS, *flags],
        gateway_flags=[*GATEWAY_FLAGS, *flags],
        workers=1,
        gateways=1,
    )
    seed = SMALL_SEEDS[0]
    expected = references.get(seed, SMALL_TURNS)

    async def body() -> None:
        client = await RealtimeClient.connect(stack.realtime_url(0), "json")
        opened = await client.open(**SESSION_CONFIG)
        await turns(client, seed, 1, 3, expected)
        await client.disconnect()
        again = await RealtimeClient.connect(stack.realtime_url(0), "json")
        resumed = await again.resume(opened.session_id, opened.resume_token, last_seq=3)  # read back
        assert resumed.last_seq == 3
        assert await again.close() == SessionClosed("closed")

    asyncio.run(asyncio.wait_for(body(), 120))
