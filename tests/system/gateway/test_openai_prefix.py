"""Two OpenAI-dialect conversations with the same instructions share their KV and stay exact (#33).

Real processes on loopback: the OpenAI modules' shared stack (redis-server, SmolLM2-135M workers
with the prefix cache on, the default, and a gateway with auth on), through the official `openai`
SDK. Two conversations with the same long instructions run one after the other: both must equal,
token for token, transformers' own model of the same GGUF generating greedily over the whole
conversation rendered by the model's chat template (tests/system/gateway/openai_reference.py, this
plan's `reference`). The second must land on the worker that holds the instructions' pages (the
dialect names them in its open, and placement prefers a worker that publishes them) and map them
there (that worker's /metrics).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from gateway.auth.api_keys import KeyStore
from shared.store.registry import read_worker
from shared.store.schema import KeySchema
from tests.processes import http_get
from tests.system.gateway.openai_reference import PREFIX_INSTRUCTIONS, PREFIX_PLANS, TURNS, PendingReferences
from tests.system.gateway.stack import Stack
from tests.system.gateway.test_openai import (
    MODEL,
    base_url,
    new_key,
    newest_session_worker,
    respond,
    run,
    until,
    user,
)
from tests.wait import await_until

PLAN = "prefix_turns"  # openai_reference.PREFIX_PLANS: these instructions, test_openai's two turns
MAX_TOKENS = PREFIX_PLANS[PLAN]["max_output_tokens"]


@pytest.fixture(scope="module")
def stack(openai_stack: Stack) -> Stack:
    return openai_stack


@pytest.fixture(scope="module")
def transformers_reference(stack: Stack, smollm2_transformers_dir: Path) -> Iterator[PendingReferences]:
    """The conversation's reference by transformers, computing once the stack is up (it runs
    beside the conversations, not beside the workers' boot)."""
    pending = PendingReferences(PREFIX_PLANS, smollm2_transformers_dir)
    try:
        yield pending
    finally:
        pending.stop()


def prefix_metric(stack: Stack, worker: str, name: str) -> float:
    status, text = http_get(f"http://127.0.0.1:{stack.workers[worker].port}/metrics")
    assert status == 200
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_two_conversations_with_the_same_instructions_share_them_and_stay_exact(
    stack: Stack, transformers_reference: PendingReferences
) -> None:
    async def conversation(keys: KeyStore, redis: Redis) -> tuple[list[str], str]:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(
                session={
                    "type": "realtime",
                    "instructions": PREFIX_INSTRUCTIONS,
                    "output_modalities": ["text"],
                }
            )
            await until(conn, "session.updated")
            texts = []
            for text in TURNS:
                await conn.conversation.item.create(item=user(text))  # type: ignore[arg-type]
                await until(conn, "conversation.item.added")
                reply, _done, _ = await respond(conn, MAX_TOKENS)
                texts.append(reply)
            worker = await newest_session_worker(redis, KeySchema(stack.prefix))
        return texts, worker

    async def published(redis: Redis) -> set[str]:
        schema = KeySchema(stack.prefix)
        infos = [await read_worker(redis, schema, worker) for worker in stack.workers]
        return {name for info in infos if info is not None for name in info.prefixes}

    async def both(keys: KeyStore, redis: Redis) -> tuple[list[Any], str, list[Any], str, float, float]:
        before = await published(redis)
        first, holder = await conversation(keys, redis)

        async def holds_it() -> bool:
            info = await read_worker(redis, KeySchema(stack.prefix), holder)
            return info is not None and bool(set(info.prefixes) - before)

        # The holder publishes the instructions' name on its next heartbeat: then placement knows.
        await await_until(holds_it, 30, f"{holder} to publish the instructions' prefix")
        hits, reused = (
            prefix_metric(stack, holder, f"microturn_worker_prefix_cache_{n}_total")
            for n in ("hits", "tokens_reused")
        )
        second, placed = await conversation(keys, redis)
        return first, holder, second, placed, hits, reused

    first, holder, second, placed, hits, reused = run(stack, both)
    want = transformers_reference.result(PLAN)
    assert PREFIX_PLANS[PLAN]["reference"] == "transformers"
    assert first == want["texts"] and second == want["texts"]
    assert placed == holder  # the preference, whichever worker the load rule would pick
    assert prefix_metric(stack, holder, "microturn_worker_prefix_cache_hits_total") == hits + 1
    # The instructions rendered as the system message span several full pages, all mapped.
    reused_now = prefix_metric(stack, holder, "microturn_worker_prefix_cache_tokens_reused_total")
    assert reused_now - reused >= 4 * 16
