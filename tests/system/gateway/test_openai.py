"""The OpenAI Realtime dialect through the official `openai` SDK, unchanged, against a real stack
(issue #18): redis-server, two SmolLM2-135M workers and a gateway with auth on, as processes
(conftest's `openai_stack`, shared with test_openai_sdks.py).

What must hold: a two-turn conversation equals, token for token, the engine alone fed the whole
conversation rendered by the model's chat template (tests/system/gateway/openai_reference.py);
what the SDK cannot do right gets `error` events and the socket stays open; a model no worker
serves is named in an error; client secrets work once; a wrong key is refused; a worker killed
mid-response costs the client nothing but time (the reply completes, exact).
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from openai import AsyncOpenAI, AuthenticationError
from redis.asyncio import Redis

from gateway.auth.api_keys import KeyStore
from shared.protocol.key_limits import KeyLimits
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.processes import http_get
from tests.system.gateway.openai_reference import INSTRUCTIONS, PLANS, STORY, TURNS, PendingReferences
from tests.system.gateway.stack import Stack, stop
from tests.wait import await_until

T = TypeVar("T")
MODEL = "smollm2-135m"
TEST_TIMEOUT_S = 300.0
MAX_TOKENS = PLANS["turns"]["max_output_tokens"]
STORY_TOKENS = PLANS["story"]["max_output_tokens"]


@pytest.fixture(scope="module")
def stack(openai_stack: Stack) -> Stack:
    return openai_stack


def run(stack: Stack, body: Callable[[KeyStore, Redis], Coroutine[Any, Any, T]]) -> T:
    async def main() -> T:
        redis = Redis.from_url(stack.redis_url, decode_responses=False)
        try:
            return await asyncio.wait_for(
                body(KeyStore(redis, KeySchema(stack.prefix)), redis), TEST_TIMEOUT_S
            )
        finally:
            await redis.aclose()

    return asyncio.run(main())


def base_url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.gateways[0].port}/v1"


async def new_key(keys: KeyStore) -> str:
    secret, _ = await keys.create(f"k{uuid.uuid4().hex[:8]}", KeyLimits())
    return secret


async def newest_session_worker(redis: Redis, schema: KeySchema) -> str:
    """The worker of the newest session (earlier tests' sessions may still idle on theirs)."""
    records = []
    async for key in redis.scan_iter(match=schema.session("*")):
        record = await read_session(redis, schema, key.decode().rsplit(":", 1)[1].strip("{}"))
        if record is not None:
            records.append(record)
    return max(records, key=lambda r: r.created_ms).worker


def metric(stack: Stack, name: str) -> float:
    status, text = http_get(f"http://127.0.0.1:{stack.gateways[0].port}/metrics")
    assert status == 200
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def until(conn: Any, kind: str, seen: list[Any] | None = None) -> Any:
    """Events up to the first of type `kind` (collected into `seen`), which is returned."""
    while True:
        event = await conn.recv()
        if seen is not None:
            seen.append(event)
        if event.type == kind:
            return event


async def respond(conn: Any, max_output_tokens: int) -> tuple[str, Any, list[Any]]:
    await conn.response.create(response={"max_output_tokens": max_output_tokens})
    seen: list[Any] = []
    done = await until(conn, "response.done", seen)
    deltas = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    text_done = next(e.text for e in seen if e.type == "response.output_text.done")
    assert deltas == text_done
    assert [e.type for e in seen if e.type == "error"] == []
    return text_done, done, seen


def test_two_turns_through_the_sdk_equal_the_engine_fed_the_whole_conversation(
    stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model=MODEL) as conn:
            created = await conn.recv()
            assert created.type == "session.created" and created.session.model == MODEL
            await conn.session.update(
                session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
            )
            assert (await until(conn, "session.updated")).session.instructions == INSTRUCTIONS
            texts, usages = [], []
            for text in TURNS:
                await conn.conversation.item.create(item=user(text))  # type: ignore[arg-type]
                added = await until(conn, "conversation.item.added")
                assert added.item.content[0].text == text
                reply, done, _ = await respond(conn, MAX_TOKENS)
                texts.append(reply)
                usages.append(done.response.usage)
        want = openai_references.result("turns")
        print(f"[openai] replies {texts!r}; usage {[(u.input_tokens, u.output_tokens) for u in usages]}")
        assert texts == want["texts"]
        assert [u.output_tokens for u in usages] == [len(r) for r in want["replies"]]
        # Turn 2 found turn 1's whole conversation in the KV: it paid only for its own tokens.
        assert usages[1].input_token_details.cached_tokens == usages[0].input_tokens + usages[0].output_tokens

    run(stack, body)
    status, metrics = http_get(f"http://127.0.0.1:{stack.gateways[0].port}/metrics")
    assert status == 200 and 'microturn_gateway_dialect_turns_total{dialect="openai"}' in metrics


def test_what_the_model_cannot_do_gets_error_events_and_the_socket_stays_open(stack: Stack) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.input_audio_buffer.append(audio="AAAA", event_id="audio_1")
            error = await until(conn, "error")
            assert error.error.event_id == "audio_1" and "audio" in error.error.message
            await conn.send({"type": "session.fly", "event_id": "bad_2"})  # type: ignore[typeddict-item]
            error = await until(conn, "error")
            assert error.error.type == "invalid_request_error" and error.error.event_id == "bad_2"
            await conn.conversation.item.create(item=user("Hello"), event_id="it_3")  # type: ignore[arg-type]
            item_id = (await until(conn, "conversation.item.added")).item.id
            # Truncate is defined by audio time (delete is served since #35: test_openai_edits.py).
            await conn.conversation.item.truncate(
                item_id=item_id, content_index=0, audio_end_ms=0, event_id="trunc_4"
            )
            error = await until(conn, "error")
            assert error.error.event_id == "trunc_4" and error.error.code == "unsupported_operation"
            _reply, done, _ = await respond(conn, 4)  # still open and serving
            assert done.response.status in ("completed", "incomplete")

    run(stack, body)


def test_a_model_no_worker_serves_is_named_in_an_error(stack: Stack) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model="gpt-realtime") as conn:
            error = await conn.recv()
            assert error.type == "error" and error.error.code == "model_not_found"
            assert MODEL in error.error.message and "gpt-realtime" in error.error.message

    run(stack, body)


def test_a_wrong_key_is_refused_as_a_revoked_one_is(stack: Stack) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        revoked_name = f"k{uuid.uuid4().hex[:8]}"
        revoked, _ = await keys.create(revoked_name, KeyLimits())
        assert await keys.revoke(revoked_name)
        messages = []
        for key in ("mt_" + "x" * 43, revoked):
            client = AsyncOpenAI(base_url=base_url(stack), api_key=key)
            async with client.realtime.connect(model=MODEL) as conn:
                error = await conn.recv()
                assert error.type == "error" and error.error.code == "unauthorized"
                messages.append(error.error.message)
            with pytest.raises(AuthenticationError):
                await client.realtime.client_secrets.create()
        assert messages[0] == messages[1]

    run(stack, body)


def test_a_client_secret_starts_one_session_with_its_settings(stack: Stack) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        server = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        settings = {"type": "realtime", "model": MODEL, "instructions": "Be terse.", "max_output_tokens": 8}
        secret = await server.realtime.client_secrets.create(
            expires_after={"anchor": "created_at", "seconds": 120},
            session=settings,  # type: ignore[arg-type]
        )
        assert secret.value.startswith("mtb_") and secret.session.model == MODEL
        browser = AsyncOpenAI(base_url=base_url(stack), api_key=secret.value)
        async with browser.realtime.connect(model="another-model") as conn:  # not the secret's model
            error = await conn.recv()
            assert error.type == "error" and error.error.code == "model_mismatch"
        async with browser.realtime.connect(model=MODEL) as conn:
            created = await conn.recv()
            assert created.type == "session.created"
            assert (created.session.instructions, created.session.max_output_tokens) == ("Be terse.", 8)
            await conn.conversation.item.create(item=user("Hi"))  # type: ignore[arg-type]
            await until(conn, "conversation.item.done")
        # Spent: a second session with the same secret is refused when it would open.
        async with browser.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.conversation.item.create(item=user("Hi again"))  # type: ignore[arg-type]
            error = await until(conn, "error")
            assert error.error.code == "unauthorized"

    run(stack, body)


def test_a_worker_killed_mid_response_is_invisible_but_for_latency(
    stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.conversation.item.create(item=user(STORY))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": STORY_TOKENS})
            seen: list[Any] = []
            await until(conn, "response.output_text.delta", seen)
            victim = await newest_session_worker(redis, KeySchema(stack.prefix))
            stack.workers[victim].popen.send_signal(signal.SIGKILL)
            # The module's next test wants two workers: a replacement boots while the reply ends.
            replacement = asyncio.create_task(asyncio.to_thread(stack.start_worker, "w-replacement"))
            done = await until(conn, "response.done", seen)
            await replacement
        assert [e.type for e in seen if e.type == "error"] == []
        text = next(e.text for e in seen if e.type == "response.output_text.done")
        assert "".join(e.delta for e in seen if e.type == "response.output_text.delta") == text
        want = openai_references.result("story")
        assert text == want["texts"][0] and done.response.usage.output_tokens == len(want["replies"][0])

    run(stack, body)
    assert metric(stack, "microturn_gateway_sessions_restored_total") >= 1  # it did move


def test_a_drained_worker_moves_the_conversation_which_stays_exact(
    stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(keys: KeyStore, redis: Redis) -> list[str]:
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        texts = []
        async with client.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session={"type": "realtime", "instructions": INSTRUCTIONS})
            for turn, text in enumerate(TURNS):
                if turn == 1:  # between the turns: the worker drains, the session moves
                    victim = await newest_session_worker(redis, KeySchema(stack.prefix))
                    await asyncio.to_thread(stop, stack.workers.pop(victim))
                await conn.conversation.item.create(item=user(text))  # type: ignore[arg-type]
                reply, _, _ = await respond(conn, MAX_TOKENS)
                texts.append(reply)
        return texts

    texts = run(stack, body)
    # No worker takes the drained one's place: the module's later tests need one worker, not two.
    assert texts == openai_references.result("turns")["texts"]
    assert metric(stack, "microturn_gateway_sessions_migrated_total") >= 1  # it did move


def test_a_keys_limits_apply_in_the_dialect(stack: Stack) -> None:
    async def body(keys: KeyStore, redis: Redis) -> None:
        secret, _ = await keys.create(
            f"k{uuid.uuid4().hex[:8]}", KeyLimits(max_session_s=3, max_tokens_per_day=10**6)
        )
        client = AsyncOpenAI(base_url=base_url(stack), api_key=secret)
        async with client.realtime.connect(model=MODEL) as conn:
            assert (await conn.recv()).type == "session.created"
            rates = await conn.recv()
            assert rates.type == "rate_limits.updated" and rates.rate_limits[0].limit == 10**6
            await conn.conversation.item.create(item=user("Hi"))  # type: ignore[arg-type]
            error = await until(conn, "error")  # the session outlives its key's 3 s
            assert error.error.code == "session_expired"

    run(stack, body)


def test_the_socket_ending_closes_its_session(stack: Stack) -> None:
    """The OpenAI dialect has no resume: a socket's end closes its session on the worker, and its
    record goes (a native socket's end only detaches)."""

    async def body(keys: KeyStore, redis: Redis) -> None:
        schema = KeySchema(stack.prefix)
        client = AsyncOpenAI(base_url=base_url(stack), api_key=await new_key(keys))
        async with client.realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.conversation.item.create(item=user("Hello"))  # type: ignore[arg-type]
            await until(conn, "conversation.item.done")
            sids = [key.decode() async for key in redis.scan_iter(match=schema.session("*"))]
            assert sids

        async def gone() -> bool:
            left = [key async for key in redis.scan_iter(match=schema.session("*"))]
            return not set(sids) & {key.decode() for key in left}

        await await_until(gone, 30, "the closed session's record to go")

    run(stack, body)
