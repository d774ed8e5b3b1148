"""Tools in the OpenAI dialect as a Sans-I/O translator (gateway/openai/tools.py, call_parser.py,
calling_response.py): what a tool session appends to the KV, the grammar its responses carry, how a
streamed call becomes `function_call` events (each validated by openai-python's own types), and the
refusals that change nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from gateway.openai.call_parser import ArgumentsDelta, CallEnded, CallParser, CallStarted, Text
from gateway.openai.tools import (
    FunctionTool,
    NamedFunction,
    as_template,
    call_text,
    constraint,
    output_content,
    system_content,
)
from shared.protocol.messages import InputChunk, OutputDelta, SessionOpened
from shared.store.models import ModelCard
from tests.gateway import test_openai_dialect
from tests.gateway.test_openai_dialect import (
    EOS,
    Harness,
    done,
    template_of,
    texts,
    types,
    user,
)

# SmolLM2's card, the dialect tests' fixture (pytest finds it by its own name, `card`).
smollm2_card = test_openai_dialect.card
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL = FunctionTool("get_weather", WEATHER["description"], WEATHER["parameters"])


def tool_session(card: ModelCard, choice: object = "required") -> Harness:
    h = Harness(card)
    session = {"type": "realtime", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": choice}
    (updated,) = h.reply({"type": "session.update", "session": session})
    assert updated["type"] == "session.updated", updated
    assert updated["session"]["tools"] == [WEATHER] and updated["session"]["tool_choice"] == choice
    return h


def stream(h: Harness, seq: int, pieces: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for index, text in enumerate(pieces):
        out += h.encode(OutputDelta(seq, index, 100 + index, text))
    return out


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7])
def test_the_parser_splits_text_and_one_call_however_the_text_is_cut(cut: int) -> None:
    whole = "Let me see." + call_text("get_weather", '{"city": "Paris"}')
    parser = CallParser()
    pieces = []
    for i in range(0, len(whole), cut):
        pieces += parser.feed(whole[i : i + cut])
    pieces += parser.finish()
    shown = "".join(p.text for p in pieces if isinstance(p, Text))
    arguments = "".join(p.text for p in pieces if isinstance(p, ArgumentsDelta))
    assert shown == "Let me see."
    assert [p for p in pieces if isinstance(p, CallStarted)] == [CallStarted("get_weather")]
    assert arguments == '{"city": "Paris"}'
    assert pieces[-1] == CallEnded('{"city": "Paris"}', True)


def test_a_call_cut_short_ends_incomplete_and_text_that_only_looks_like_one_stays_text() -> None:
    parser = CallParser()
    pieces = parser.feed(call_text("get_weather", '{"city": "Par')[: -len("}\n</tool_call>")])
    assert parser.finish() == [CallEnded('{"city": "Par', False)]
    assert CallStarted("get_weather") in pieces
    plain = CallParser()
    out = plain.feed("a <tool") + plain.feed("_callx> b") + plain.finish()
    assert "".join(p.text for p in out if isinstance(p, Text)) == "a <tool_callx> b"


@pytest.mark.parametrize("choice", ["auto", "required", NamedFunction("get_weather")])
def test_the_grammar_is_the_one_xgrammar_builds_for_the_hermes_format(choice: object) -> None:
    fmt = constraint((TOOL,), choice)  # type: ignore[arg-type]
    assert fmt is not None and fmt.tag is not None
    ours = xgr.StructuralTag.model_validate(fmt.tag)
    named = {"type": "function", "function": {"name": "get_weather"}}
    reference = xgr.get_model_structural_tag(
        "qwen_3",
        tools=[{"type": "function", "function": TOOL.signature()}],
        tool_choice="auto" if isinstance(choice, str) else named,
        reasoning="disabled",
        parallel_tool_calls=False,
    )
    # The same call tag (begin, the schema, end); `required` starts with it rather than after text.
    ref_tag: Any = reference.format.tags[0] if isinstance(choice, str) else reference.format  # type: ignore[union-attr]
    our_tag: Any = ours.format.tags[0] if choice == "auto" else ours.format  # type: ignore[union-attr]
    assert (our_tag.begin, our_tag.end) == (ref_tag.begin, ref_tag.end)
    assert our_tag.content.json_schema == ref_tag.content.json_schema
    assert constraint((TOOL,), "none") is None and constraint((), "auto") is None


def test_a_required_call_streams_as_a_function_call_item_and_its_output_joins(
    smollm2_card: ModelCard,
) -> None:
    template = template_of(smollm2_card)
    h = tool_session(smollm2_card)
    first = h.send(user("Weather in Paris?"))
    item_seq = first.messages[-1].seq  # type: ignore[union-attr]
    h.encode(SessionOpened("s", "t", "smollm2-135m"))
    h.encode(done(item_seq, committed=30))
    response = h.send({"type": "response.create"})
    assert types([json.loads(r) for r in response.replies]) == ["response.created"]  # items open lazily
    (chunk,) = response.messages
    assert isinstance(chunk, InputChunk) and chunk.response_format == constraint((TOOL,), "required")

    call = call_text("get_weather", '{"city": "Paris"}')
    pieces = [call[:20], call[20:40], call[40:52], call[52:]]
    streamed = stream(h, chunk.seq, pieces) + h.encode(OutputDelta(chunk.seq, 9, EOS, "<|im_end|>"))
    closing = h.encode(done(chunk.seq, (100, 101, 102, 103, EOS), "stop", committed=5))
    kinds = types(streamed + closing)
    assert kinds[:2] == ["response.output_item.added", "conversation.item.added"]
    assert kinds[-4:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert "response.output_text.delta" not in kinds
    deltas = [e["delta"] for e in streamed if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(deltas) == '{"city": "Paris"}'
    (final,) = closing[-1]["response"]["output"]
    assert (final["type"], final["name"], final["arguments"], final["status"]) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert closing[-1]["response"]["status"] == "completed"

    # The output joins as the call's answer; then a response with tool_choice "none" answers in text.
    output = {"type": "function_call_output", "call_id": final["call_id"], "output": '{"temp": 21}'}
    joined = h.send({"type": "conversation.item.create", "item": output})
    (added,) = [json.loads(r) for r in joined.replies]
    assert added["item"]["type"] == "function_call_output" and added["previous_item_id"] == final["id"]
    after = h.send({"type": "response.create", "response": {"tool_choice": "none"}})
    assert isinstance(after.messages[0], InputChunk) and after.messages[0].response_format is None
    conversation = [
        {"role": "system", "content": system_content("Be brief.", (TOOL,))},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": call},
        {"role": "user", "content": output_content('{"temp": 21}')},
    ]
    assert texts(first.messages) + texts(response.messages) + call + "<|im_end|>" + texts(
        joined.messages
    ) + texts(after.messages) == template.render(conversation, add_generation_prompt=True)


def test_auto_streams_text_then_a_call_as_two_items(smollm2_card: ModelCard) -> None:
    h = tool_session(smollm2_card, "auto")
    h.send(user("Weather?"))
    (chunk,) = h.send({"type": "response.create"}).messages
    assert isinstance(chunk, InputChunk) and chunk.response_format == constraint((TOOL,), "auto")
    streamed = stream(h, chunk.seq, ["Checking.", call_text("get_weather", '{"city": "Oslo"}')])
    closing = h.encode(done(chunk.seq, (100, 101), "length"))
    output = closing[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Checking." and output[1]["arguments"] == '{"city": "Oslo"}'
    indices = {e["output_index"] for e in streamed if e["type"] == "response.function_call_arguments.delta"}
    assert indices == {1}
    added = [e for e in streamed if e["type"] == "conversation.item.added"]
    assert added[1]["previous_item_id"] == output[0]["id"]


@pytest.mark.parametrize(
    ("event", "param"),
    [
        ({"type": "session.update", "session": {"tools": [{"type": "function"}]}}, "session.tools[0].name"),
        (
            {
                "type": "session.update",
                "session": {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            },
            "session.tool_choice",
        ),
        (
            {"type": "session.update", "session": {"tools": [{"type": "mcp", "server_label": "x"}]}},
            "session.tools[0].type",
        ),
        (
            {"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "nope"}}},
            "response.tool_choice",
        ),
        (
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": "call_x", "output": "1"},
            },
            "item.call_id",
        ),
    ],
)
def test_bad_tool_input_gets_a_typed_error_and_changes_nothing(
    smollm2_card: ModelCard, event: dict[str, Any], param: str
) -> None:
    h = tool_session(smollm2_card)
    before = texts(h.send(user("Hi")).messages)
    decoded = h.send({**event, "event_id": "bad"})
    (error,) = [json.loads(r) for r in decoded.replies]
    assert decoded.messages == ()
    assert (
        error["type"] == "error" and error["error"]["param"] == param and error["error"]["event_id"] == "bad"
    )
    assert error["error"]["type"] == "invalid_request_error"
    # Nothing changed: the session keeps its tools and choice, and the next response is held to them.
    (updated,) = h.reply({"type": "session.update", "session": {}})
    assert updated["session"]["tools"] == [WEATHER] and updated["session"]["tool_choice"] == "required"
    (chunk,) = h.send({"type": "response.create"}).messages
    assert isinstance(chunk, InputChunk) and chunk.response_format == constraint((TOOL,), "required")
    assert before


# A chat template with a tools section of its own, in the shape of Qwen2.5's: it lists the tools in
# its system message and renders a `tool` message as a `<tool_response>`.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You help.{% endif %}"
    "\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_a_tools_section_lists_the_tools_and_renders_the_output_itself(
    smollm2_card: ModelCard,
) -> None:
    hermes = ModelCard(
        smollm2_card.name,
        HERMES_TEMPLATE,
        smollm2_card.bos_token,
        smollm2_card.eos_token,
        smollm2_card.eos_token_ids,
    )
    template = template_of(hermes)
    assert template.has_tools_section and not template_of(smollm2_card).has_tools_section
    h = tool_session(hermes)
    first = h.send(user("Weather in Paris?"))
    h.encode(SessionOpened("s", "t", "smollm2-135m"))
    response = h.send({"type": "response.create"})
    (chunk,) = response.messages
    assert isinstance(chunk, InputChunk)
    call = call_text("get_weather", '{"city": "Paris"}')
    stream(h, chunk.seq, [call])
    h.encode(OutputDelta(chunk.seq, 1, EOS, "<|im_end|>"))
    closing = h.encode(done(chunk.seq, (100, EOS), "stop"))
    (final,) = closing[-1]["response"]["output"]
    output = {"type": "function_call_output", "call_id": final["call_id"], "output": "21 C"}
    joined = h.send({"type": "conversation.item.create", "item": output})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "21 C"},
    ]
    whole = texts(first.messages) + texts(response.messages) + call + "<|im_end|>" + texts(joined.messages)
    assert whole == template.render(messages, tools=as_template((TOOL,)))
    assert whole.count("get_weather") == 2 and "# Tools\n<tools>" in whole  # listed once, by the template


def test_an_output_sent_while_its_response_runs_queues_and_joins_after_it(smollm2_card: ModelCard) -> None:
    """As the Agents SDKs do: they run the tool at the call's `response.output_item.done`, before
    `response.done`, and send its output and the next `response.create` at once."""
    h = tool_session(smollm2_card)
    h.send(user("Weather?"))
    (chunk,) = h.send({"type": "response.create"}).messages
    assert isinstance(chunk, InputChunk)
    streamed = stream(h, chunk.seq, [call_text("get_weather", '{"city": "Rome"}')])
    (item_done,) = [e for e in streamed if e["type"] == "response.output_item.done"]
    output = {"type": "function_call_output", "call_id": item_done["item"]["call_id"], "output": "sunny"}
    queued = h.send({"type": "conversation.item.create", "item": output})
    follow = h.send({"type": "response.create"})
    assert queued.messages == () and queued.replies == () and follow.messages == ()  # both wait
    h.encode(OutputDelta(chunk.seq, 1, EOS, "<|im_end|>"))
    closing = h.encode(done(chunk.seq, (100, EOS), "stop"))
    kinds = types(closing)
    assert kinds.index("response.done") < kinds.index("conversation.item.added")
    (added,) = [e for e in closing if e["type"] == "conversation.item.added"]
    assert added["item"]["type"] == "function_call_output"
    assert added["previous_item_id"] == item_done["item"]["id"]
    released = h.dialect.take_released()
    assert [m.max_output_tokens for m in released if isinstance(m, InputChunk)][-1] > 0  # its response
    assert "<tool_response>\nsunny\n</tool_response>" in "".join(
        m.text or "" for m in released if isinstance(m, InputChunk)
    )


def test_an_out_of_band_tool_choice_and_a_bad_delete_are_refused_and_change_nothing(
    smollm2_card: ModelCard,
) -> None:
    """#35's edits beside #36's tools: an out-of-band response with a tool_choice of its own (a call
    it made would belong to no conversation) and a delete of an unknown item get a typed error and
    leave the conversation as it was (deleting tool items works: test_openai_edit_units.py)."""
    h = tool_session(smollm2_card)
    first = h.send(user("Weather in Paris?"))
    item_seq = first.messages[-1].seq  # type: ignore[union-attr]
    h.encode(SessionOpened("s", "t", "smollm2-135m"))
    for sent in first.messages:  # every chunk of the item answered: nothing in flight
        if isinstance(sent, InputChunk):
            h.encode(done(sent.seq, committed=30 if sent.seq == item_seq else 0))
    (chunk,) = h.send({"type": "response.create"}).messages
    assert isinstance(chunk, InputChunk)
    stream(h, chunk.seq, [call_text("get_weather", '{"city": "Paris"}')])
    h.encode(OutputDelta(chunk.seq, 9, EOS, "<|im_end|>"))
    h.encode(done(chunk.seq, (100, EOS), "stop", committed=5))
    conversation = h.dialect._conversation
    assert conversation is not None
    before = [item.item_id for item in conversation.items]

    for event, code in [
        ({"type": "conversation.item.delete", "item_id": "nope"}, "item_not_found"),
        (
            {"type": "response.create", "response": {"conversation": "none", "tool_choice": "required"}},
            "unsupported_value",
        ),
    ]:
        decoded = h.send(event)
        assert decoded.messages == ()
        (error,) = [json.loads(r) for r in decoded.replies]
        assert error["type"] == "error" and error["error"]["code"] == code, error
        assert [item.item_id for item in conversation.items] == before
