"""Conversations that change, through OpenAI's Python SDK, unchanged, on the real stack (issue #35,
point 2): SmolLM2 workers and an auth-on gateway (conftest's `openai_stack`).

- `response.create` with `conversation: "none"` answers over the conversation plus a question of
  its own, echoes its `metadata`, adds nothing to the conversation;
- the same over a question of its own only, `conversation.item.delete` of the first item (the
  instructions are the kept prefix) and of a turn the user takes back while its reply streams,
  then a delete whose worker is killed before it answers;

and after each, the conversation's next response is exactly the one the model gives the
conversation without them (the engine fed the whole conversation rendered by the chat template:
openai_reference.py's `sdk_turns`).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from openai import AsyncOpenAI
from redis.asyncio import Redis

from shared.store.schema import KeySchema
from tests.system.gateway.openai_reference import (
    INSTRUCTIONS,
    SIDE_QUESTION,
    SIDE_TOKENS,
    TURNS,
    PendingReferences,
)
from tests.system.gateway.stack import Stack
from tests.system.gateway.test_openai import newest_session_worker, until
from tests.system.gateway.test_openai_sdks import MAX_TOKENS, MODEL, expected, run, user


async def _added(conn: Any, text: str, seen: list[Any]) -> str:
    """A user item created and in the session (its `conversation.item.done`): its id."""
    await conn.conversation.item.create(item=user(text))
    return str((await until(conn, "conversation.item.done", seen)).item.id)


async def _until_done(conn: Any, seen: list[Any]) -> Any:
    while (event := await conn.recv()).type != "response.done":
        seen.append(event)
    seen.append(event)
    return event


def test_an_out_of_band_answer_leaves_the_conversation_exact(
    openai_stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(api_key: str) -> tuple[list[str], Any, list[Any]]:
        client = AsyncOpenAI(base_url=f"{openai_stack.gateways[0].http}/v1", api_key=api_key)
        seen: list[Any] = []
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(
                session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
            )
            await conn.conversation.item.create(item=user(TURNS[0]))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            first = await _until_done(conn, seen)
            ids = [item.id for item in first.response.output]
            user_item = next(e.item.id for e in seen if e.type == "conversation.item.added")
            side = {
                "conversation": "none",
                "metadata": {"purpose": "classify"},
                "max_output_tokens": 4,
                "input": [
                    {"type": "item_reference", "id": user_item},
                    {"type": "item_reference", "id": ids[0]},
                    user("In one word: is this a greeting?"),
                ],
            }
            mark = len(seen)
            await conn.response.create(response=side)  # type: ignore[arg-type]
            side_done = await _until_done(conn, seen)
            side_events = seen[mark:]
            await conn.conversation.item.create(item=user(TURNS[1]))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            await _until_done(conn, seen)
        texts = [
            e.text
            for e in seen
            if e.type == "response.output_text.done" and e.response_id != side_done.response.id
        ]
        return texts, side_done, side_events

    texts, side_done, side_events = run(openai_stack, body)
    kinds = [e.type for e in side_events]
    print(f"[openai out-of-band] side answer {side_done.response.output[0].content[0].text!r}")
    assert "error" not in kinds, side_events
    assert "conversation.item.added" not in kinds and "conversation.item.done" not in kinds
    assert side_done.response.metadata == {"purpose": "classify"}
    assert side_done.response.conversation_id is None
    assert texts == expected(openai_references)


def test_edits_then_a_worker_kill_leave_the_conversation_exact(
    openai_stack: Stack, openai_references: PendingReferences
) -> None:
    """Points 1 to 4 in the dialect, one conversation (instructions kept as the session's prefix):
    - the first item, deleted before its chunk is answered (the delete waits for it, then goes
      back to where the instructions end);
    - TURNS[0] and its reply;
    - an out-of-band response over a question of its own only: answered exactly as the
      instructions and that question alone (`side_question`), then the conversation put back;
    - a turn the user takes back: both its items deleted while its reply still streams (the
      deletes wait for it);
    - an aside, then TURNS[1]; the session's worker stopped, the aside deleted (its rewind sent to
      the stopped worker, TURNS[1] to be sent again behind it), the worker killed (SIGKILL): the
      session is restored on another worker from the log, the rewind and TURNS[1] go again there,
      `conversation.item.deleted` comes once, and TURNS[1] is answered exactly as the conversation
      TURNS[0], its reply, TURNS[1] (`sdk_turns`), with no error."""

    async def body(api_key: str) -> tuple[list[str], str, list[str], list[Any]]:
        # The stack may be down to one worker (test_openai.py drains one): another boots meanwhile.
        replacement = asyncio.create_task(asyncio.to_thread(openai_stack.start_worker, "w-edits"))
        client = AsyncOpenAI(base_url=f"{openai_stack.gateways[0].http}/v1", api_key=api_key)
        seen: list[Any] = []
        texts: list[str] = []
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(
                session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
            )
            await conn.conversation.item.create(item=user("Hello there."))  # type: ignore[arg-type]
            added = await until(conn, "conversation.item.added", seen)
            await conn.conversation.item.delete(item_id=added.item.id)
            deleted = [(await until(conn, "conversation.item.deleted", seen)).item_id]

            await conn.conversation.item.create(item=user(TURNS[0]))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            texts.append((await _until_done(conn, seen)).response.output[0].content[0].text)

            side = {"conversation": "none", "max_output_tokens": SIDE_TOKENS, "input": [user(SIDE_QUESTION)]}
            await conn.response.create(response=side)  # type: ignore[arg-type]
            side_text = (await _until_done(conn, seen)).response.output[0].content[0].text

            await conn.conversation.item.create(item=user("Never mind that, tell me a joke."))  # type: ignore[arg-type]
            asked = (await until(conn, "conversation.item.added", seen)).item.id
            await conn.response.create(response={"max_output_tokens": 6})
            reply = (await until(conn, "response.output_item.added", seen)).item.id
            for item_id in (reply, asked):  # while the reply streams: they wait for it
                await conn.conversation.item.delete(item_id=item_id)
            for _ in range(2):
                deleted.append((await until(conn, "conversation.item.deleted", seen)).item_id)

            aside = await _added(conn, "Wait, one more thing.", seen)
            turn = await _added(conn, TURNS[1], seen)
            await replacement
            redis = Redis.from_url(openai_stack.redis_url)
            try:
                victim = openai_stack.workers[
                    await newest_session_worker(redis, KeySchema(openai_stack.prefix))
                ]
            finally:
                await redis.aclose()
            victim.popen.send_signal(signal.SIGSTOP)
            try:
                await conn.conversation.item.delete(item_id=aside)
                await conn.conversation.item.retrieve(item_id=turn)  # answered once the delete went out
                await until(conn, "conversation.item.retrieved", seen)
            finally:
                victim.popen.send_signal(signal.SIGKILL)
            deleted.append((await until(conn, "conversation.item.deleted", seen)).item_id)
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            texts.append((await _until_done(conn, seen)).response.output[0].content[0].text)
        return texts, side_text, [added.item.id, reply, asked, aside, *deleted], seen

    texts, side_text, ids, seen = run(openai_stack, body)
    print(f"[openai edits] side answer {side_text!r}, replies {texts!r}")
    assert [e for e in seen if e.type == "error"] == []
    first, reply, asked, aside, *deleted = ids
    assert deleted == [first, reply, asked, aside]
    assert sum(e.type == "conversation.item.deleted" for e in seen) == len(deleted)  # each once
    assert side_text == openai_references.result("side_question")["texts"][0]
    assert texts == expected(openai_references)
