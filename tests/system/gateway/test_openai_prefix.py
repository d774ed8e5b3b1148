"""Two OpenAI-dialect conversations with the same instructions share their KV and stay exact (#33).

Real processes on loopback: redis-server, one SmolLM2-135M worker (prefix cache on, the default)
and a gateway with auth on, through the official `openai` SDK. Two conversations with the same long
instructions run one after the other: both must equal, token for token, transformers' own model
of the same GGUF generating greedily over the whole conversation rendered by the model's chat
template (tests/system/gateway/openai_reference.py, this plan's `reference`), and the second must
have mapped the instructions' pages the first computed (the worker's /metrics).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import AsyncOpenAI
from redis.asyncio import Redis

from gateway.auth.api_keys import KeyStore
from tests.conftest import Servers
from tests.processes import http_get
from tests.system.gateway.conftest import OPENAI_GATEWAY_FLAGS, OPENAI_WORKER_FLAGS
from tests.system.gateway.openai_reference import PREFIX_INSTRUCTIONS, PREFIX_PLANS, TURNS, PendingReferences
from tests.system.gateway.stack import Stack
from tests.system.gateway.test_openai import MODEL, base_url, new_key, respond, run, until, user

PLAN = "prefix_turns"  # openai_reference.PREFIX_PLANS: these instructions, test_openai's two turns
MAX_TOKENS = PREFIX_PLANS[PLAN]["max_output_tokens"]


@pytest.fixture(scope="module")
def stack(servers: Servers) -> Stack:
    # One worker, so both conversations land where the first one's pages are cached.
    return servers.stack(
        workers=1, gateways=1, worker_flags=OPENAI_WORKER_FLAGS, gateway_flags=OPENAI_GATEWAY_FLAGS
    )


@pytest.fixture(scope="module")
def transformers_reference(stack: Stack) -> Iterator[PendingReferences]:
    """The conversation's reference by transformers, computed once the stack is up (it runs beside
    the conversations, not beside the worker's boot)."""
    pending = PendingReferences(PREFIX_PLANS)
    try:
        yield pending
    finally:
        pending.stop()


def prefix_metric(stack: Stack, name: str) -> float:
    (worker,) = stack.workers.values()
    status, text = http_get(f"http://127.0.0.1:{worker.port}/metrics")
    assert status == 200
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_two_conversations_with_the_same_instructions_share_them_and_stay_exact(
    stack: Stack, transformers_reference: PendingReferences
) -> None:
    async def conversation(keys: KeyStore, redis: Redis) -> list[str]:
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
        return texts

    first: list[Any] = run(stack, conversation)
    hits, reused = (
        prefix_metric(stack, f"microturn_worker_prefix_cache_{n}_total") for n in ("hits", "tokens_reused")
    )
    second: list[Any] = run(stack, conversation)
    want = transformers_reference.result(PLAN)
    assert PREFIX_PLANS[PLAN]["reference"] == "transformers"
    assert first == want["texts"] and second == want["texts"]
    assert prefix_metric(stack, "microturn_worker_prefix_cache_hits_total") == hits + 1
    # The instructions rendered as the system message span several full pages, all mapped.
    assert prefix_metric(stack, "microturn_worker_prefix_cache_tokens_reused_total") - reused >= 4 * 16
