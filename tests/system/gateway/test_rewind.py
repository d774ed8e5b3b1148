"""Rewinds over the native protocol, on the real stack (issue #35, points 1, 3, 4 and 5).

Real processes on loopback: Redis, two `tiny` workers, one gateway, greedy sampling. What a rewound
session says next is held against a session that was sent the rewound history whole (a session
streamed in chunks is the same conversation as one sent whole: docs/design.md), on the same stack.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import pytest

from shared.client.clients import RealtimeClient
from shared.errors import InvalidMessage
from shared.protocol.messages import OutputDone, SessionRestored, SessionRewind, SessionRewound
from shared.store.connection import resilient_redis
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.conftest import Servers
from tests.system.gateway.conftest import GATEWAY_FLAGS, LINK_SECRET
from tests.system.gateway.stack import Stack, stop

CONFIG = {"stop_token_ids": [], "max_output_tokens": 0}
PROMPT = [(7 * j) % 500 + 3 for j in range(12)]


@pytest.fixture(scope="module")
def rewind_stack(servers: Servers) -> Iterator[Stack]:
    flags = [*LINK_SECRET, "--kv-tokens", "4096", "--heartbeat-s", "0.5"]
    yield servers.stack(workers=2, gateways=1, worker_flags=flags, gateway_flags=GATEWAY_FLAGS)


async def _history(client: RealtimeClient, turns: list[tuple[list[int], int]]) -> list[int]:
    """Run `turns` (tokens, outputs) from seq 0; the history they make."""
    history: list[int] = []
    for seq, (tokens, outputs) in enumerate(turns):
        done = await client.turn(seq, tokens, max_output_tokens=outputs)
        history += [*tokens, *done.tokens]
    return history


async def _as_whole(url: str, history: list[int], tokens: list[int], outputs: int) -> OutputDone:
    """What a session sent `history` whole answers to one more chunk."""
    async with await RealtimeClient.connect(url) as whole:
        await whole.open(**CONFIG)
        await whole.turn(0, history, max_output_tokens=0)
        return await whole.turn(1, tokens, max_output_tokens=outputs)


def test_rewinds_answer_as_the_rewound_history_sent_whole(rewind_stack: Stack) -> None:
    url = rewind_stack.realtime_url(0)

    async def body() -> None:
        async with await RealtimeClient.connect(url) as client:
            await client.open(**CONFIG)
            history = await _history(client, [(PROMPT, 0), ([5, 6, 7, 8], 6), ([9, 10, 11, 12], 6)])
            # Back to right after turn 1's output.done: its outputs stay, turn 2 goes.
            rewound = await client.rewind(to_seq=1)
            assert rewound.length == 12 + 4 + 6
            history = history[: rewound.length]
            # The last turn, finished, keeps the first 2 of its 5 outputs (what a barge-in heard).
            reply = await client.turn(3, [13, 14], max_output_tokens=5)
            kept = await client.cancel_keeping(3, 2)
            assert kept.length == len(history) + 2 + 2
            history += [13, 14, *reply.tokens[:2]]
            # A token count, inside turn 1's input.
            assert (await client.rewind(keep_tokens=14)).length == 14
            history = history[:14]
            # Refusals change nothing: the next turn still answers as the history sent whole.
            for bad in ({"to_seq": 2}, {"to_seq": 99}, {"keep_tokens": 15}):
                with pytest.raises(InvalidMessage):
                    await client.rewind(**bad)
            with pytest.raises(InvalidMessage):
                await client.cancel_keeping(3, 1)  # turn 3 is no longer the session's last
            got = await client.turn(4, [21, 22, 23], max_output_tokens=4)
        want = await _as_whole(url, history, [21, 22, 23], 4)
        assert got.tokens == want.tokens

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_rewind_cancels_the_running_turn_first(rewind_stack: Stack) -> None:
    url = rewind_stack.realtime_url(0)

    async def body() -> None:
        async with await RealtimeClient.connect(url) as client:
            await client.open(**CONFIG)
            history = await _history(client, [(PROMPT, 2)])
            await client.send_chunk(1, [30, 31], max_output_tokens=400)
            await client.send_chunk(2, [32], max_output_tokens=4)
            rewound = await client.rewind(to_seq=0)
            assert rewound.length == len(history)
            running, queued = await client.wait_done(1), await client.wait_done(2)
            assert running.finish == queued.finish == "cancelled"
            assert queued.committed_tokens == 0  # it never entered the history
            got = await client.turn(3, [33, 34], max_output_tokens=4)
        assert got.tokens == (await _as_whole(url, history, [33, 34], 4)).tokens

    asyncio.run(asyncio.wait_for(body(), 120))


def test_a_worker_killed_after_a_rewind_and_during_one_leaves_the_edited_history(rewind_stack: Stack) -> None:
    """Points 3 and 4: a rewind is in the log before it is answered, so the session restored on the
    other worker continues from the rewound history; and a rewind the worker never answered (it is
    stopped, the rewind and a chunk behind it sent, then it is killed) goes again to the next
    worker, answered once, from the history the log gave it (it still knows where turn 1 ends),
    with the chunk run after it. Last in the module: it leaves the stack one worker."""
    url = rewind_stack.realtime_url(0)

    async def body() -> None:
        redis = resilient_redis(rewind_stack.redis_url)
        try:
            async with await RealtimeClient.connect(url) as client:
                await client.open(**CONFIG)
                history = await _history(client, [(PROMPT, 0), ([5, 6, 7, 8], 6), ([9, 10, 11, 12], 6)])
                rewound = await client.rewind(to_seq=1)
                history = history[: rewound.length]
                got = await client.turn(3, [40, 41], max_output_tokens=4)
                assert client.session_id is not None
                record = await read_session(redis, KeySchema(rewind_stack.prefix), client.session_id)
                assert record is not None
                worker = rewind_stack.workers[record.worker]
                worker.popen.send_signal(signal.SIGSTOP)
                try:
                    await client.send(SessionRewind(to_seq=1))  # turn 3 goes again
                    await client.send_chunk(4, [40, 41], max_output_tokens=4)
                    await client.ping()  # the gateway has both: the rewind sent, the chunk held behind it
                finally:
                    stop(worker, signal.SIGKILL)
                again = await client.wait_done(4)
                await client.ping()
                assert any(isinstance(m, SessionRestored) for m in client.buffered)
                assert [m for m in client.buffered if isinstance(m, SessionRewound)] == [rewound]
                assert again.tokens == got.tokens
        finally:
            await redis.aclose()
        assert got.tokens == (await _as_whole(url, history, [40, 41], 4)).tokens

    asyncio.run(asyncio.wait_for(body(), 120))
