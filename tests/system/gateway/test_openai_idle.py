"""An OpenAI-dialect session that goes idle ends with an `error` event before the close (#18).

Its own stack: one SmolLM2-135M worker whose sessions idle out after 2 s, one gateway, auth off.
"""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI
from websockets.exceptions import ConnectionClosed

from tests.conftest import Servers
from tests.system.gateway.stack import Stack

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def stack(servers: Servers) -> Stack:
    flags = ["--model", MODEL, "--idle-timeout-s", "2", "--heartbeat-s", "0.5"]
    return servers.stack(workers=1, gateways=1, worker_flags=flags)


def test_idle_timeout_is_an_error_event_then_the_close(stack: Stack) -> None:
    async def body() -> list[str]:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.gateways[0].port}/v1", api_key="auth-off")
        kinds = []
        async with client.realtime.connect(model=MODEL) as conn:
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
            await conn.conversation.item.create(item=item)  # type: ignore[arg-type]
            try:
                while True:  # then nothing: the session idles out on its worker
                    event = await conn.recv()
                    kinds.append(event.type if event.type != "error" else f"error:{event.error.code}")
            except ConnectionClosed:
                kinds.append("closed")
        return kinds

    kinds = asyncio.run(asyncio.wait_for(body(), 120))
    assert kinds == [
        "session.created",
        "conversation.item.added",
        "conversation.item.done",
        "error:idle_timeout",
        "closed",
    ]
