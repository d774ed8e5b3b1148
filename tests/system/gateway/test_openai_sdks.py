"""OpenAI's own client stacks, unchanged, against a real stack with auth on (issue #25): redis-server,
SmolLM2-135M workers and a gateway (conftest's `openai_stack`, shared with test_openai.py), and a
second gateway serving TLS with a self-signed certificate.

What must hold, each conversation exact against the engine fed the whole conversation rendered by
the model's chat template (openai_reference.py), with no `error` event:
- the Python Agents SDK (`RealtimeAgent` + `RealtimeRunner`) and the JavaScript one
  (`@openai/agents-realtime`'s `RealtimeSession` over its WebSocket transport), two turns each:
  their `session.update` carries audio formats, transcription, turn detection and a voice, which
  the gateway keeps and echoes; audio actually sent still gets its typed error;
- the npm `openai` SDK's Node client (`OpenAIRealtimeWS`), which only dials wss://, over TLS;
- a user item sent while a response streams joins after it, and its own response follows.

Kept short on purpose (SmolLM2 runs on CPU here): every test holds the same two-turn conversation,
computed once by the reference.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from agents.realtime import RealtimeAgent, RealtimeRunner
from openai import AsyncOpenAI
from redis.asyncio import Redis

from gateway.auth.api_keys import KeyStore
from shared.protocol.key_limits import KeyLimits
from shared.store.schema import KeySchema
from tests.processes import REPO, Proc
from tests.shared.tls import Certificate, self_signed
from tests.system.gateway.conftest import OPENAI_GATEWAY_FLAGS
from tests.system.gateway.openai_reference import INSTRUCTIONS, PLANS, TURNS, PendingReferences
from tests.system.gateway.stack import Stack

T = TypeVar("T")
MODEL = "smollm2-135m"
TEST_TIMEOUT_S = 240.0
MAX_TOKENS = PLANS["sdk_turns"]["max_output_tokens"]
NODE_DIR = REPO / "tests" / "node"


@pytest.fixture(scope="module")
def stack(openai_stack: Stack) -> Stack:
    return openai_stack


def expected(openai_references: PendingReferences) -> list[str]:
    texts: list[str] = openai_references.result("sdk_turns")["texts"]
    return texts


def run(stack: Stack, body: Callable[[str], Coroutine[Any, Any, T]]) -> T:
    """`body(api_key)` with a fresh key, under the test's time limit."""

    async def main() -> T:
        redis = Redis.from_url(stack.redis_url, decode_responses=False)
        try:
            secret, _ = await KeyStore(redis, KeySchema(stack.prefix)).create(
                f"k{uuid.uuid4().hex[:8]}", KeyLimits()
            )
        finally:
            await redis.aclose()
        return await asyncio.wait_for(body(secret), TEST_TIMEOUT_S)

    return asyncio.run(main())


def realtime_url(gateway: Proc) -> str:
    return f"{gateway.ws}/v1/realtime?model={MODEL}"


def node_or_skip() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the JavaScript SDK tests need Node 20+ and `make test`")
    if not (NODE_DIR / "node_modules" / "@openai" / "agents-realtime").is_dir():
        pytest.skip("tests/node/node_modules is missing: `make test` installs it with `npm ci`")
    return node


def run_node(script: str, plan: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [node_or_skip(), script],
        cwd=NODE_DIR,
        input=json.dumps(plan),
        capture_output=True,
        text=True,
        timeout=TEST_TIMEOUT_S,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_python_agents_sdk_holds_the_conversation_exactly_with_no_error(
    stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(api_key: str) -> tuple[list[str], list[Any], list[str], Any]:
        agent = RealtimeAgent(name="Assistant", instructions=INSTRUCTIONS)
        settings = {"model_name": MODEL, "output_modalities": ["text"], "max_output_tokens": MAX_TOKENS}
        runner = RealtimeRunner(agent, config={"model_settings": settings})  # type: ignore[typeddict-item]
        session = await runner.run(model_config={"url": realtime_url(stack.gateways[0]), "api_key": api_key})
        texts: list[str] = []
        errors: list[Any] = []
        raw: list[str] = []
        audio_error = None
        async with session:
            events = aiter(session)
            for turn in [*TURNS, None]:
                if turn is None:  # the conversation is done: now audio, which the model lacks
                    await session.send_audio(b"\x00\x00" * 480)
                else:
                    await session.send_message(turn)
                async for event in events:
                    if event.type == "error":  # what the SDK surfaces to the application
                        errors.append(event.error)
                        if turn is None:
                            break
                    if event.type != "raw_model_event" or event.data.type != "raw_server_event":
                        continue
                    server_event = event.data.data
                    raw.append(server_event["type"])
                    if server_event["type"] == "response.output_text.done":
                        texts.append(server_event["text"])
                    if server_event["type"] == "error":
                        audio_error = server_event["error"]
                    if server_event["type"] == "response.done":
                        break
        return texts, errors, raw, audio_error

    texts, errors, raw, audio_error = run(stack, body)
    print(f"[agents-python] replies {texts!r}")
    assert audio_error is not None and audio_error["code"] == "audio_unsupported", raw
    assert len(errors) == 1, errors  # the audio's, surfaced to the application: none before it
    assert raw.count("session.updated") >= 1 and raw.count("error") == 1, raw
    assert texts == expected(openai_references)


def test_the_javascript_agents_sdk_holds_the_conversation_exactly_with_no_error(
    stack: Stack, openai_references: PendingReferences
) -> None:
    node_or_skip()

    async def body(api_key: str) -> dict[str, Any]:
        plan = {
            "url": realtime_url(stack.gateways[0]),
            "apiKey": api_key,
            "model": MODEL,
            "instructions": INSTRUCTIONS,
            "turns": TURNS,
            "maxOutputTokens": MAX_TOKENS,
        }
        return await asyncio.to_thread(run_node, "agents_session.mjs", plan)

    out = run(stack, body)
    print(f"[agents-js] replies {out['texts']!r}")
    assert out["errors"] == [], out["errors"]
    assert "session.updated" in out["types"] and "error" not in out["types"]
    assert out["texts"] == expected(openai_references)


@pytest.fixture(scope="module")
def tls_gateway(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[Proc, Certificate]:
    cert = self_signed(tmp_path_factory.mktemp("tls"))
    if cert is None:
        pytest.skip("openssl is not installed: no certificate for the TLS gateway")
    flags = [*OPENAI_GATEWAY_FLAGS, "--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key)]
    return stack.start_extra_gateway("gateway-tls", flags, tls=True), cert


def test_the_node_sdk_holds_the_conversation_over_wss_with_a_self_signed_certificate(
    stack: Stack, tls_gateway: tuple[Proc, Certificate], openai_references: PendingReferences
) -> None:
    node_or_skip()
    gateway, cert = tls_gateway
    assert gateway.http.startswith("https://")

    async def body(api_key: str) -> dict[str, Any]:
        plan = {
            "baseURL": f"{gateway.http}/v1",
            "apiKey": api_key,
            "model": MODEL,
            "instructions": INSTRUCTIONS,
            "turns": TURNS,
            "maxOutputTokens": MAX_TOKENS,
        }
        trust = {"NODE_EXTRA_CA_CERTS": str(cert.cert)}
        return await asyncio.to_thread(run_node, "openai_wss.mjs", plan, trust)

    out = run(stack, body)
    print(f"[openai-node wss] replies {out['texts']!r}")
    assert out["errors"] == [] and "error" not in out["types"]
    assert out["texts"] == expected(openai_references)


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def test_an_item_sent_while_a_response_streams_joins_after_it_and_is_answered_exactly(
    stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(api_key: str) -> tuple[list[str], list[Any]]:
        client = AsyncOpenAI(base_url=f"{stack.gateways[0].http}/v1", api_key=api_key)
        seen: list[Any] = []
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(
                session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
            )
            await conn.conversation.item.create(item=user(TURNS[0]))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            while (event := await conn.recv()).type != "response.output_text.delta":
                seen.append(event)
            seen.append(event)
            sent_at = len(seen)
            # Mid-stream: the next user turn and its response, as a user who keeps talking.
            await conn.conversation.item.create(item=user(TURNS[1]), event_id="late_item")  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS}, event_id="late_response")
            done = 0
            while done < 2:
                event = await conn.recv()
                seen.append(event)
                done += event.type == "response.done"
        texts = [e.text for e in seen if e.type == "response.output_text.done"]
        first_id = next(e.response.id for e in seen if e.type == "response.done")
        streamed_after = [e for e in seen[sent_at:] if getattr(e, "response_id", None) == first_id]
        print(f"[openai queued] {len(streamed_after)} events of the first response came after the late item")
        return texts, seen

    texts, seen = run(stack, body)
    kinds = [e.type for e in seen]
    print(f"[openai queued] replies {texts!r}")
    assert "error" not in kinds, [e for e in seen if e.type == "error"]
    first_done = kinds.index("response.done")
    # The late item is added only once the first response is done, right after its reply item.
    added = [
        (i, e) for i, e in enumerate(seen) if e.type == "conversation.item.added" and e.item.role == "user"
    ]
    late_index, late = added[-1]
    assert late.item.content[0].text == TURNS[1] and late_index > first_done
    first_reply = next(e for e in seen if e.type == "response.done").response.output[0].id
    assert late.previous_item_id == first_reply
    assert texts == expected(openai_references)
