"""Fault suite: a Redis Cluster master killed (SIGKILL) under load, its replica promoted (#19).

Real processes on loopback: a six-node cluster (3 masters, 3 replicas, node timeout 1.5 s), two
workers and two gateways in `--redis-mode cluster`, the tiny model, greedy. Eight sessions stream
while the master holding most of their keys is killed. What must hold: no session ends, every
chunk gets exactly one `output.done`, every output equals the uninterrupted reference (the hot path
needs no Redis; the log's flush retries); opens during the failover either succeed or get a
retryable error; and afterwards every session's record and whole log are in the cluster (the
workers re-write what the failover lost), so a resume gets the full history. Figures go to stdout.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from shared.client.clients import RealtimeClient
from shared.errors import MicroturnError
from shared.store.connection import resilient_redis
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.system.gateway.conftest import GATEWAY_FLAGS, WORKER_FLAGS
from tests.system.gateway.faults import Streamer, tally
from tests.system.gateway.reference import SESSION_CONFIG, PendingReferences, stream
from tests.system.gateway.test_fault_redis import full_sequence
from tests.wait import await_until
from worker.server.token_log import read_log

SEEDS = tuple(range(24, 32))
TURNS = 50
KILL_AT = 15
PROBE_OPENS = 6  # at least; more while the failover lasts
PROBE_PACE_S = 0.25  # the probes' pace (a load, not a wait: the loop ends when the failover has)
FAILOVER_TIMEOUT_S = 60.0
CLUSTER = ["--redis-mode", "cluster"]


def test_a_master_killed_under_load_costs_no_turn(servers: Servers, references: PendingReferences) -> None:
    cluster = servers.redis_cluster()
    stack = servers.stack(
        cluster.url, worker_flags=[*WORKER_FLAGS, *CLUSTER], gateway_flags=[*GATEWAY_FLAGS, *CLUSTER]
    )
    schema = KeySchema(stack.prefix)
    expected = {seed: references.get(seed, TURNS) for seed in SEEDS}

    async def body() -> None:
        streamers = [await Streamer.open(stack.realtime_url(seed % 2), seed, TURNS) for seed in SEEDS]
        receivers = [asyncio.create_task(s.receive()) for s in streamers]
        await asyncio.gather(*(s.send_until(KILL_AT) for s in streamers))
        masters = {s.session_id: cluster.master_of(schema.session(s.session_id)) for s in streamers}
        victim, held = Counter(masters.values()).most_common(1)[0]
        on_victim = [schema.session(sid) for sid, master in masters.items() if master == victim]

        def failed_over() -> bool:
            """A replica serves the killed master's slots now: the failover window is over."""
            return all(cluster.master_of(key) != victim for key in on_victim)

        cluster.kill(victim)
        killed = time.monotonic()
        print(f"[fault] killed master {victim} holding {held} of {len(SEEDS)} sessions")
        senders = asyncio.gather(*(s.send_until(TURNS) for s in streamers))
        outcomes: Counter[str] = Counter()
        probes = 0
        # Opens through the failover window, until it is over: each served, or told when to retry.
        while probes < PROBE_OPENS or not await asyncio.to_thread(failed_over):
            assert time.monotonic() - killed < FAILOVER_TIMEOUT_S, "no replica took over the master"
            i, probes = probes, probes + 1
            try:
                async with await RealtimeClient.connect(stack.realtime_url(i % 2)) as probe:
                    await probe.open(**SESSION_CONFIG)
                    await probe.close()
                    outcomes["opened"] += 1
            except MicroturnError as exc:
                assert exc.retry_after_ms is not None, exc
                outcomes[f"retry:{exc.code}"] += 1
            await asyncio.sleep(PROBE_PACE_S)
        await senders
        await asyncio.wait_for(asyncio.gather(*receivers), 120)
        result = tally(streamers, expected)
        print(result.line("cluster master killed"))
        print(f"[fault] opens during the failover: {dict(outcomes)}")
        ended = sum(1 for s in streamers if s.closed is not None or any(e.fatal for e in s.errors))
        assert ended == 0
        assert (result.continued, result.lost, result.duplicated) == (len(SEEDS), 0, 0), result
        assert result.identical == len(SEEDS), result

        redis = resilient_redis(cluster.url, "cluster")
        try:
            for s in streamers:  # what the failover lost is re-written by the worker holding it
                want = full_sequence(s.seed, expected[s.seed])

                async def whole(sid: str = s.session_id, want: list[int] = want) -> bool:
                    return bool(await read_log(redis, schema, sid) == want)

                # The record and the log live in different slots: the killed master may have held
                # either. A lost record of a session gone idle comes back with the worker's next scan
                # (every 10 beats), not at once with the log: both are waited for.
                async def recorded(sid: str = s.session_id) -> bool:
                    return await read_session(redis, schema, sid) is not None

                await await_until(whole, 60, f"the log of stream {s.seed} to be whole")
                await await_until(recorded, 60, f"the record of stream {s.seed} to be back")
            whole_s = time.monotonic() - killed
            print(f"[fault] records and whole logs in the cluster {whole_s:.2f} s after the kill")
        finally:
            await redis.aclose()

        for s in streamers:  # every session resumes through the other gateway, full history
            await s.client.disconnect()
            async with await RealtimeClient.connect(stack.realtime_url((s.seed + 1) % 2)) as again:
                resumed = await again.resume(s.session_id, s.resume_token, TURNS)
                length = len(full_sequence(s.seed, expected[s.seed]))
                assert (resumed.length, resumed.last_seq) == (length, TURNS)
                await again.close()

    asyncio.run(asyncio.wait_for(body(), 240))


def test_writes_one_shard_lost_are_rewritten_by_the_worker_that_holds_them(
    servers: Servers, references: PendingReferences
) -> None:
    """What a failover loses, made exactly (on one server: the loss is the same to the worker): a
    log cut short under an active session, a record gone under an idle one, and a cut log under a
    record that names another worker (the session moved: not this worker's to write)."""
    stack = servers.stack(workers=1, gateways=1, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS)
    schema = KeySchema(stack.prefix)
    seeds = SEEDS[:3]
    expected = {seed: references.get(seed, TURNS) for seed in seeds}

    async def body() -> None:
        redis = resilient_redis(stack.redis_url)
        clients = {seed: await RealtimeClient.connect(stack.realtime_url(0)) for seed in seeds}
        sids = {}
        try:

            async def logged(seed: int, turns: int) -> bool:
                want = full_sequence(seed, expected[seed][:turns])
                return bool(await read_log(redis, schema, sids[seed]) == want)

            active, idle, moved = seeds
            earlier = b""
            for seed, client in clients.items():
                sids[seed] = (await client.open(**SESSION_CONFIG)).session_id
                chunks = stream(seed, 6)
                for seq in range(1, 6):
                    await client.turn(seq, tokens=chunks[seq - 1])
                    if seed == active and seq == 3:
                        await await_until(lambda: logged(active, 3), 30, "three turns to be flushed")
                        earlier = await redis.get(schema.log(sids[active])) or b""
            for seed in seeds:
                await await_until(lambda seed=seed: logged(seed, 5), 30, "the logs to be flushed")
            # A failover loses whole writes, the last ones: the log as it was after turn 3.
            await redis.set(schema.log(sids[active]), earlier)
            await redis.delete(schema.session(sids[idle]))  # its record lost
            await redis.hset(schema.session(sids[moved]), "worker", "another-worker")
            await redis.set(schema.log(sids[moved]), b"")
            done = await clients[active].turn(6, tokens=stream(active, 6)[5])  # the append finds it short
            assert list(done.tokens) == expected[active][5]
            await await_until(lambda: logged(active, 6), 30, "the cut log to be re-written")

            async def recorded() -> bool:
                return await read_session(redis, schema, sids[idle]) is not None

            await await_until(recorded, 30, "the idle session's record to be re-written")
            record = await read_session(redis, schema, sids[idle])
            assert record is not None and record.worker == "w0" and await logged(idle, 5)
            assert await redis.get(schema.log(sids[moved])) == b""  # not this worker's to write
        finally:
            for client in clients.values():
                await client.disconnect()
            await redis.aclose()

    asyncio.run(asyncio.wait_for(body(), 120))
