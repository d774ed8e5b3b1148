"""Admission through a live gateway: refusals keep the seq, pastes queue whole, the client retries.

Real processes on loopback (Valkey, one tiny worker with a small KV pool, gateways). Outputs are
compared with a session that was never refused, on the same worker (greedy, no early stop).
"""

from __future__ import annotations

import asyncio

import pytest

from loadtest.capacity.metrics import by_label, scrape
from shared.client.clients import RealtimeClient, RetryPolicy
from shared.client.retry import NO_RETRY
from shared.errors import CapacityExhausted, ErrorCode, RateLimited
from shared.protocol.messages import Error, OutputDelta, OutputDone
from tests.conftest import Servers
from tests.system.gateway.conftest import LINK_SECRET
from tests.system.gateway.stack import Stack
from tests.wait import await_until

TEST_TIMEOUT_S = 120.0
# 256 KV tokens: one long turn holds most of the pool, so another session's chunk cannot fit.
WORKER_FLAGS = [*LINK_SECRET, "--kv-tokens", "256", "--max-sessions", "16"]
CONFIG = {"max_output_tokens": 0, "stop_token_ids": [], "stream": True}
PARAGRAPH = ("I paste a paragraph: it has words, numbers like 1234, and <|im_start|> tokens. " * 6)[:200]


@pytest.fixture(scope="module")
def stack(servers: Servers) -> Stack:
    flags = [*LINK_SECRET, "--open-timeout-s", "20"]
    return servers.stack(
        servers.redis("valkey"), workers=1, gateways=1, worker_flags=WORKER_FLAGS, gateway_flags=flags
    )


def run(body: asyncio.Future[None] | object) -> None:
    asyncio.run(asyncio.wait_for(body, TEST_TIMEOUT_S))  # type: ignore[arg-type]


async def hog_the_pool(url: str) -> RealtimeClient:
    """A session whose running turn reserves most of the KV pool (until it is cancelled)."""
    hog = await RealtimeClient.connect(url, "msgpack")
    await hog.open(**CONFIG)
    await hog.send_chunk(1, tokens=[1] * 20, max_output_tokens=200)
    assert isinstance(await hog.recv(timeout=30), OutputDelta)  # running: its pages are reserved
    return hog


async def capacity_refusals(stack: Stack) -> float:
    """How many `capacity_exhausted` errors the gateway has sent its clients (its /metrics)."""
    samples = await asyncio.to_thread(scrape, stack.gateways[0].http + "/metrics")
    return by_label(samples, "microturn_gateway_errors_total").get(ErrorCode.CAPACITY_EXHAUSTED, 0.0)


async def release(hog: RealtimeClient) -> None:
    await hog.cancel(1)
    assert (await hog.wait_done(1)).finish in ("cancelled", "length")
    await hog.close()


def test_capacity_refusal_keeps_the_seq_and_the_retry_is_accepted(stack: Stack) -> None:
    url = stack.realtime_url(0)
    text = "c" * 60  # 60 tokens on the tiny byte-level tokenizer: does not fit beside the hog

    async def body() -> None:
        async with await RealtimeClient.connect(url, "msgpack") as reference:
            await reference.open(**CONFIG)
            first = await reference.turn(1, text="ab")
            expected = await reference.turn(2, text=text, max_output_tokens=3)
            after = await reference.turn(3, tokens=[5, 6], max_output_tokens=3)
            await reference.close()
        hog = await hog_the_pool(url)
        async with await RealtimeClient.connect(url, "msgpack", retry=NO_RETRY) as client:
            await client.open(**CONFIG)
            assert (await client.turn(1, text="ab")).committed_tokens == first.committed_tokens
            with pytest.raises(CapacityExhausted) as refused:
                await client.turn(2, text=text, max_output_tokens=3)
            assert refused.value.retry_after_ms
            await release(hog)
            retried = await client.turn(2, text=text, max_output_tokens=3)  # the same seq, accepted
            assert (retried.tokens, retried.committed_tokens) == (expected.tokens, expected.committed_tokens)
            assert (await client.turn(3, tokens=[5, 6], max_output_tokens=3)).tokens == after.tokens
            await client.close()

    run(body())


def test_the_client_retries_a_refused_chunk_by_itself(stack: Stack) -> None:
    url = stack.realtime_url(0)
    tight = stack.realtime_url(
        stack.start_extra_gateway(
            "gateway-tight-rate", [*LINK_SECRET, "--max-chunks-per-s", "4", "--chunk-burst", "2"]
        )
    )

    async def body() -> None:
        async with await RealtimeClient.connect(url) as reference:
            await reference.open(**CONFIG)
            expected = [
                (await reference.turn(seq, tokens=[seq, 7], max_output_tokens=2)).tokens
                for seq in (1, 2, 3, 4)
            ]
            await reference.close()
        # Rate limited: four chunks sent at once against a burst of 2; the client resends the refused.
        async with await RealtimeClient.connect(tight, retry=RetryPolicy(attempts=10)) as client:
            await client.open(**CONFIG)
            for seq in (1, 2, 3, 4):
                await client.send_chunk(seq, tokens=[seq, 7], max_output_tokens=2)
            assert [(await client.wait_done(seq)).tokens for seq in (1, 2, 3, 4)] == expected
            await client.close()
        async with await RealtimeClient.connect(tight, retry=NO_RETRY) as client:
            await client.open(**CONFIG)
            for seq in (1, 2, 3):
                await client.send_chunk(seq, tokens=[seq], max_output_tokens=0)
            await client.wait_done(1)
            await client.wait_done(2)
            with pytest.raises(RateLimited):  # retries off: the refusal is the caller's
                await client.wait_done(3)
            await client.close()
        # Capacity: the client waits out the hog by itself; the session equals the unrefused one.
        # 2 + 40 tokens need 3 pages; the hog leaves 2 of the 16: refused until the hog is gone.
        hog = await hog_the_pool(url)
        async with await RealtimeClient.connect(url, "msgpack", retry=RetryPolicy(attempts=50)) as client:
            await client.open(**CONFIG)
            refused_before = await capacity_refusals(stack)
            turn = asyncio.create_task(client.turn(1, tokens=[1, 7], max_output_tokens=40))

            async def refused() -> bool:
                return await capacity_refusals(stack) > refused_before

            await await_until(refused, 30, "the chunk to be refused for capacity")  # then freed
            await release(hog)
            done = await turn
            assert len(done.tokens) == 40 and done.tokens[:2] == expected[0]  # greedy: the same start
            await client.close()

    run(body())


def test_a_paste_as_twenty_pieces_is_accepted_whole(stack: Stack) -> None:
    """Behind a running turn, twenty text pieces all queue (default limits), committing the whole text."""
    url = stack.realtime_url(0)
    pieces = [PARAGRAPH[i : i + 10] for i in range(0, len(PARAGRAPH), 10)]
    assert len(pieces) == 20

    async def body() -> None:
        async with await RealtimeClient.connect(url, "msgpack") as whole:
            await whole.open(**CONFIG)
            expected = await whole.turn(1, text=PARAGRAPH, flush=True)
            await whole.close()
        async with await RealtimeClient.connect(url, "msgpack", retry=NO_RETRY) as client:
            await client.open(**CONFIG)
            await client.send_chunk(1, tokens=[3], max_output_tokens=20)  # a running turn
            for seq, piece in enumerate(pieces, start=2):
                await client.send_chunk(seq, text=piece)
            await client.send_chunk(22, text="", flush=True)
            await client.wait_done(1)
            dones = [await client.wait_done(seq) for seq in range(2, 23)]
            assert all(isinstance(d, OutputDone) and d.tokens == () for d in dones)
            assert sum(d.committed_tokens or 0 for d in dones) == expected.committed_tokens
            assert not [m for m in client.buffered if isinstance(m, Error)]
            await client.close()

    run(body())
