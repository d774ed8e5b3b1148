"""Conversations that change, through OpenAI's Python SDK, unchanged, on the real stack (issue #35,
point 2): SmolLM2 workers and an auth-on gateway (conftest's `openai_stack`).

- `response.create` with `conversation: "none"` answers over the conversation plus a question of
  its own, echoes its `metadata`, adds nothing to the conversation;
- `conversation.item.delete` of a turn the user takes back (the reply, then the question);

and after each, the conversation's next response is exactly the one the model gives the
conversation without them (the engine fed the whole conversation rendered by the chat template:
openai_reference.py's `sdk_turns`).
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from tests.system.gateway.openai_reference import INSTRUCTIONS, TURNS, PendingReferences
from tests.system.gateway.stack import Stack
from tests.system.gateway.test_openai_sdks import MAX_TOKENS, MODEL, expected, run, user


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


def test_deleted_items_leave_the_conversation_as_if_never_sent(
    openai_stack: Stack, openai_references: PendingReferences
) -> None:
    """Point 2 (delete): a turn the user takes back (their item and the reply to it) is deleted;
    the next turn answers exactly as the conversation without them (the same `sdk_turns` reference:
    TURNS[0], its reply, TURNS[1])."""

    async def body(api_key: str) -> tuple[list[str], list[str]]:
        client = AsyncOpenAI(base_url=f"{openai_stack.gateways[0].http}/v1", api_key=api_key)
        seen: list[Any] = []
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(
                session={"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
            )
            await conn.conversation.item.create(item=user(TURNS[0]))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            await _until_done(conn, seen)
            await conn.conversation.item.create(item=user("Never mind that, tell me a joke."))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": 6})
            taken_back = await _until_done(conn, seen)
            asked = [e.item.id for e in seen if e.type == "conversation.item.added" and e.item.role == "user"]
            deleted: list[str] = []
            for item_id in (taken_back.response.output[0].id, asked[1]):  # the reply, then the question
                await conn.conversation.item.delete(item_id=item_id)
                while (event := await conn.recv()).type != "conversation.item.deleted":
                    assert event.type != "error", event
                deleted.append(event.item_id)
            await conn.conversation.item.create(item=user(TURNS[1]))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            await _until_done(conn, seen)
        texts = [
            e.text
            for e in seen
            if e.type == "response.output_text.done" and e.response_id != taken_back.response.id
        ]
        return texts, deleted

    texts, deleted = run(openai_stack, body)
    assert len(deleted) == 2
    assert texts == expected(openai_references)
