"""Function tools through OpenAI's own clients, unchanged, against the shared real stack (issue #36;
conftest's `openai_stack`: redis-server, SmolLM2-135M workers, a gateway with auth on).

What must hold, with no `error` event:
- the `openai` SDK: a session with one function tool, a response under `required` streams a
  well-formed `function_call` (its arguments as deltas, then done), the call's output joins, and
  the next response (`auto`) follows it; the whole conversation equals the engine alone fed it
  rendered whole, each reply under the same grammar (openai_reference.py's `tool_turns`);
- the Python Agents SDK (`RealtimeAgent` with a `function_tool`) and the JavaScript one
  (`@openai/agents-realtime`'s `tool()`), the first response asking for `required`: the SDK gets
  the call, runs the tool with the model's arguments, sends its output and asks for the next
  response itself, which completes.

Kept cheap: one short question, one call, one reply after it, on the stack the other OpenAI
modules share.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner
from agents.realtime.model_inputs import RealtimeModelSendRawMessage
from openai import AsyncOpenAI

from gateway.openai.tools import call_text
from tests.system.gateway.openai_reference import (
    INSTRUCTIONS,
    PLANS,
    WEATHER_OUTPUT,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    PendingReferences,
)
from tests.system.gateway.stack import Stack
from tests.system.gateway.test_openai_sdks import MODEL, realtime_url, run, run_node

MAX_TOKENS = PLANS["tool_turns"]["max_output_tokens"]


@pytest.fixture(scope="module")
def stack(openai_stack: Stack) -> Stack:
    return openai_stack


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def raw_reply(output: list[Any]) -> str:
    """A response's reply as the model generated it: its text, then its call in the tool format."""
    text = "".join(part.text for item in output if item.type == "message" for part in item.content)
    calls = "".join(call_text(item.name, item.arguments) for item in output if item.type == "function_call")
    return text + calls


def test_the_openai_sdk_gets_a_required_call_sends_its_output_and_the_reply_follows_exactly(
    stack: Stack, openai_references: PendingReferences
) -> None:
    async def body(api_key: str) -> list[Any]:
        client = AsyncOpenAI(base_url=f"{stack.gateways[0].http}/v1", api_key=api_key)
        seen: list[Any] = []

        async def until_done() -> Any:
            while (event := await conn.recv()).type != "response.done":
                seen.append(event)
            seen.append(event)
            return event.response

        async with client.realtime.connect(model=MODEL) as conn:
            session = {
                "type": "realtime",
                "instructions": INSTRUCTIONS,
                "output_modalities": ["text"],
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
            }
            await conn.session.update(session=session)  # type: ignore[arg-type]
            await conn.conversation.item.create(item=user(WEATHER_QUESTION))  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS})
            first = await until_done()
            (call,) = first.output
            output = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_OUTPUT}
            await conn.conversation.item.create(item=output)  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": MAX_TOKENS, "tool_choice": "auto"})
            await until_done()
        return seen

    seen = run(stack, body)
    kinds = [e.type for e in seen]
    assert "error" not in kinds, [e for e in seen if e.type == "error"]
    first, second = [e.response for e in seen if e.type == "response.done"]
    (call,) = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert set(json.loads(call.arguments)) == {"city"}  # well-formed, the function's schema
    deltas = [e.delta for e in seen if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in seen if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments and done.call_id == call.call_id
    joined = [
        e.item for e in seen if e.type == "conversation.item.added" and e.item.type == "function_call_output"
    ]
    assert [item.call_id for item in joined] == [call.call_id]
    replies = [raw_reply(first.output), raw_reply(second.output)]
    print(f"[openai tools] replies {replies!r}")
    assert replies == openai_references.result("tool_turns")["texts"]
    assert second.status == "completed"
    # The reply after the output found the whole conversation so far in the KV: nothing re-sent.
    assert second.usage.input_token_details.cached_tokens == first.usage.total_tokens


def test_the_python_agents_sdk_runs_a_required_tool_and_the_reply_follows(stack: Stack) -> None:
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return WEATHER_OUTPUT

    async def body(api_key: str) -> tuple[list[str], list[Any], list[Any]]:
        agent = RealtimeAgent(name="Assistant", instructions=INSTRUCTIONS, tools=[get_weather])
        settings = {"model_name": MODEL, "output_modalities": ["text"], "max_output_tokens": MAX_TOKENS}
        runner = RealtimeRunner(agent, config={"model_settings": settings})  # type: ignore[typeddict-item]
        session = await runner.run(model_config={"url": realtime_url(stack.gateways[0]), "api_key": api_key})
        raw: list[str] = []
        errors: list[Any] = []
        done: list[Any] = []
        async with session:
            # The user's turn, its first response asking for the tool: the SDK's raw send.
            item = {"type": "conversation.item.create", "other_data": {"item": user(WEATHER_QUESTION)}}
            create = {"type": "response.create", "other_data": {"response": {"tool_choice": "required"}}}
            await session.model.send_event(RealtimeModelSendRawMessage(message=item))  # type: ignore[typeddict-item]
            await session.model.send_event(RealtimeModelSendRawMessage(message=create))  # type: ignore[typeddict-item]
            async for event in session:
                if event.type == "error":
                    errors.append(event.error)
                if event.type != "raw_model_event" or event.data.type != "raw_server_event":
                    continue
                server_event = event.data.data
                raw.append(server_event["type"])
                if server_event["type"] == "response.done":
                    done.append(server_event["response"])
                    if len(done) == 2:
                        break
        return raw, errors, done

    raw, errors, done = run(stack, body)
    print(f"[agents-python tools] calls {calls!r}, reply {done[-1]['output']!r}")
    assert errors == [] and "error" not in raw, (errors, raw)
    (call,) = done[0]["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert calls == [json.loads(call["arguments"])["city"]]  # the tool ran with the model's arguments
    assert "conversation.item.added" in raw and done[1]["status"] == "completed"
    # The next response found the call in the KV: the conversation was never re-sent.
    assert done[1]["usage"]["input_token_details"]["cached_tokens"] == done[0]["usage"]["total_tokens"]


def test_the_javascript_agents_sdk_runs_a_required_tool_and_the_reply_follows(stack: Stack) -> None:
    async def body(api_key: str) -> dict[str, Any]:
        plan = {
            "url": realtime_url(stack.gateways[0]),
            "apiKey": api_key,
            "model": MODEL,
            "instructions": INSTRUCTIONS,
            "question": WEATHER_QUESTION,
            "toolOutput": WEATHER_OUTPUT,
            "maxOutputTokens": MAX_TOKENS,
        }
        return await asyncio.to_thread(run_node, "agents_tools.mjs", plan)

    out = run(stack, body)
    print(f"[agents-js tools] calls {out['calls']!r}, texts {out['texts']!r}")
    assert out["errors"] == [] and "error" not in out["types"], out["errors"]
    assert len(out["calls"]) == 1  # the SDK ran the tool once, with the model's arguments
    assert out["types"].count("response.function_call_arguments.done") == 1
    assert out["types"].count("response.done") == 2
