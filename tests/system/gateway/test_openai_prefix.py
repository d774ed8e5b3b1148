"""Two OpenAI-dialect conversations with the same instructions share their KV and stay exact (#33).

Real processes on loopback: redis-server, one SmolLM2-135M worker (prefix cache on, the default)
and a gateway with auth on, through the official `openai` SDK. Two conversations with the same long
instructions run one after the other: both must equal, token for token, the engine alone fed the
whole conversation rendered by the model's chat template (tests/system/gateway/openai_reference.py),
and the second must have mapped the instructions' pages the first computed (the worker's /metrics).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from gateway.auth.api_keys import KeyStore
from tests.conftest import Servers
from tests.processes import http_get
from tests.system.gateway import openai_reference
from tests.system.gateway.stack import Stack
from tests.system.gateway.test_openai import (
    GATEWAY_FLAGS,
    MAX_TOKENS,
    MODEL,
    TURNS,
    WORKER_FLAGS,
    base_url,
    new_key,
    respond,
    run,
    until,
    user,
)

# Long enough to fill several pages once the chat template renders it as the system message.
INSTRUCTIONS = " ".join(
    f"Rule {i}: be brief, be exact, and name the country of every city you mention." for i in range(12)
)


@pytest.fixture(scope="module")
def reference() -> Iterator[subprocess.Popen[str]]:
    yield openai_reference.start(
        {"instructions": INSTRUCTIONS, "turns": TURNS, "max_output_tokens": MAX_TOKENS}
    )


@pytest.fixture(scope="module")
def stack(servers: Servers, reference: subprocess.Popen[str]) -> Stack:
    return servers.stack(workers=1, gateways=1, worker_flags=WORKER_FLAGS, gateway_flags=GATEWAY_FLAGS)


def prefix_metric(stack: Stack, name: str) -> float:
    (worker,) = stack.workers.values()
    status, text = http_get(f"http://127.0.0.1:{worker.port}/metrics")
    assert status == 200
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_two_conversations_with_the_same_instructions_share_them_and_stay_exact(
    stack: Stack, reference: subprocess.Popen[str]
) -> None:
    async def conversation(keys: KeyStore, redis: Redis) -> list[str]:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(
                session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
            )
            await until(conn, "session.updated")
            texts = []
            for text in TURNS:
                await conn.conversation.item.create(item=user(text))  # type: ignore[arg-type]
                await until(conn, "conversation.item.added")
                reply, _done, _ = await respond(conn, MAX_TOKENS)
                texts.append(reply)
        return texts

    first: list[Any] = run(stack, conversation)
    hits, reused = (
        prefix_metric(stack, f"microturn_worker_prefix_cache_{n}_total") for n in ("hits", "tokens_reused")
    )
    second: list[Any] = run(stack, conversation)
    want = openai_reference.result(reference)
    assert first == want["texts"] and second == want["texts"]
    assert prefix_metric(stack, "microturn_worker_prefix_cache_hits_total") == hits + 1
    # The instructions rendered as the system message span several full pages, all mapped.
    assert prefix_metric(stack, "microturn_worker_prefix_cache_tokens_reused_total") - reused >= 4 * 16
