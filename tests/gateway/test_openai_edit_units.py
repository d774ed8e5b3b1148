"""The OpenAI dialect's edits (issue #35) as a Sans-I/O translator: an out-of-band response over
other items than the conversation's, deleting the first item under a kept prefix, and deletes and
out-of-band responses sent while something is in flight. Each checks the text the session is
given against the chat template's rendering of the conversation whole (what makes later turns
exact), and the order of what goes to the session."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.openai.conversation import Conversation
from gateway.openai.tools import FunctionTool, call_text, output_content, system_content
from shared.protocol.messages import (
    ClientMessage,
    InputChunk,
    OutputDelta,
    SessionOpen,
    SessionRewind,
    SessionRewound,
)
from shared.store.models import ModelCard
from tests.gateway import test_openai_dialect
from tests.gateway.test_openai_dialect import EOS, Harness, done, events, template_of, texts, types, user

card = test_openai_dialect.card  # SmolLM2's card (pytest finds the fixture by its name)

INSTRUCTIONS = "Be terse."
QUESTION = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sum up"}]}
# The conversation `_talked` builds, as the template is given it.
TALK = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Sure"},
]


def _answer(h: Harness, messages: tuple[ClientMessage, ...] | list[ClientMessage]) -> list[dict[str, Any]]:
    """Every no-output chunk among `messages` done, every rewind answered: the session is idle."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, SessionRewind):
            out += h.encode(SessionRewound(7))
        elif isinstance(message, InputChunk) and message.max_output_tokens == 0:
            out += h.encode(done(message.seq, committed=3))
    return out


def _reply(h: Harness, seq: int, text: str, token: int) -> list[dict[str, Any]]:
    h.encode(OutputDelta(seq, 0, token, text))
    h.encode(OutputDelta(seq, 1, EOS, "<|im_end|>"))
    return h.encode(done(seq, (token, EOS), "stop"))


def _talked(card: ModelCard, instructions: str | None = None) -> tuple[Harness, dict[str, int]]:
    """TALK, every chunk answered; the seq of each item's last chunk, by its text."""
    h = Harness(card)
    if instructions is not None:
        h.reply({"type": "session.update", "session": {"type": "realtime", "instructions": instructions}})
    last: dict[str, int] = {}
    for said, answer, token in (("Hi", "Hello", 28), ("Again", "Sure", 29)):
        sent = h.send(user(said)).messages
        _answer(h, sent)
        last[said] = sent[-1].seq  # type: ignore[union-attr]
        (chunk,) = h.send({"type": "response.create"}).messages
        assert isinstance(chunk, InputChunk)
        _reply(h, chunk.seq, answer, token)
        last[answer] = chunk.seq
    return h, last


def _conversation(h: Harness) -> Conversation:
    conversation = h.dialect._conversation
    assert conversation is not None
    return conversation


def _ids(h: Harness) -> list[str]:
    return [item.item_id for item in _conversation(h).items]


def _render(card: ModelCard, messages: list[dict[str, str]], *, prompt: bool = False) -> str:
    return template_of(card).render(messages, add_generation_prompt=prompt)


def _out_of_band(h: Harness, given: list[dict[str, Any]]) -> tuple[ClientMessage, ...]:
    response = {"conversation": "none", "metadata": {"k": "v"}, "max_output_tokens": 2, "input": given}
    decoded = h.send({"type": "response.create", "response": response})
    opening = events(decoded.replies)
    assert "conversation.item.added" not in types(opening)
    assert opening[0]["response"]["conversation_id"] is None
    return decoded.messages


def test_an_out_of_band_response_over_part_of_the_conversation_puts_it_back_exactly(card: ModelCard) -> None:
    """Input: the first item, then a question of its own. The session goes back to right after the
    first item, answers there, then goes back there again and gets the rest of the conversation as
    the template renders it whole; the next item appends as if the response never ran."""
    h, last = _talked(card)
    ids = _ids(h)
    rewind, *chunks = _out_of_band(h, [{"type": "item_reference", "id": ids[0]}, QUESTION])
    assert rewind == SessionRewind(to_seq=last["Hi"])
    head = _render(card, TALK[:1])
    asked = _render(card, [*TALK[:1], {"role": "user", "content": "Sum up"}], prompt=True)
    assert texts(tuple(chunks)) == asked[len(head) :]
    assert all(isinstance(c, InputChunk) for c in chunks) and chunks[-1].max_output_tokens == 2  # type: ignore[union-attr]
    assert _ids(h) == ids  # the client's conversation meanwhile

    h.encode(SessionRewound(9))
    h.encode(OutputDelta(chunks[-1].seq, 0, 30, "Greeting"))  # type: ignore[union-attr]
    closing = h.encode(done(chunks[-1].seq, (30,), "length", committed=6))  # type: ignore[union-attr]
    assert "conversation.item.done" not in types(closing)
    (response_done,) = [e for e in closing if e["type"] == "response.done"]
    assert response_done["response"]["metadata"] == {"k": "v"}
    assert response_done["response"]["output"][0]["content"][0]["text"] == "Greeting"

    restore, *again = h.dialect.take_released()
    assert restore == SessionRewind(to_seq=last["Hi"])
    assert texts(tuple(again)) == _render(card, TALK)[len(head) :]
    assert all(isinstance(c, InputChunk) and c.max_output_tokens == 0 for c in again)
    assert _ids(h) == ids
    _answer(h, [restore, *again])
    # The next item follows the whole conversation exactly.
    *_, following = h.send(user("Next")).messages
    following_text = _render(card, [*TALK, {"role": "user", "content": "Next"}])[len(_render(card, TALK)) :]
    assert isinstance(following, InputChunk) and following.text == following_text


def test_an_out_of_band_response_over_other_items_runs_after_the_kept_instructions(card: ModelCard) -> None:
    """Input: a copy of a later item only (no conversation item first). With the instructions kept
    as the prefix, the session goes back to the open's marker chunk, where they end."""
    h, _last = _talked(card, INSTRUCTIONS)
    system = {"role": "system", "content": INSTRUCTIONS}
    prefix = _render(card, [system])
    ids = _ids(h)
    rewind, *chunks = _out_of_band(h, [{"type": "item_reference", "id": ids[2]}])
    assert rewind == SessionRewind(to_seq=0)  # the marker: the kept prefix is never rewound into
    asked = _render(card, [system, {"role": "user", "content": "Again"}], prompt=True)
    assert texts(tuple(chunks)) == asked[len(prefix) :]
    h.encode(SessionRewound(4))
    h.encode(done(chunks[-1].seq, (30,), "length", committed=6))  # type: ignore[union-attr]
    restore, *again = h.dialect.take_released()
    assert restore == SessionRewind(to_seq=0)
    assert texts(tuple(again)) == _render(card, [system, *TALK])[len(prefix) :]


def test_the_first_item_is_deleted_back_to_the_kept_instructions(card: ModelCard) -> None:
    h, _last = _talked(card, INSTRUCTIONS)
    system = {"role": "system", "content": INSTRUCTIONS}
    ids = _ids(h)
    rewind, *chunks = h.send({"type": "conversation.item.delete", "item_id": ids[0]}).messages
    assert rewind == SessionRewind(to_seq=0)
    assert texts(tuple(chunks)) == _render(card, [system, *TALK[1:]])[len(_render(card, [system])) :]
    assert types(_answer(h, [rewind, *chunks])) == ["conversation.item.deleted"]
    assert _ids(h) == ids[1:]


def test_edits_sent_while_a_response_runs_wait_in_order_with_the_input_around_them(card: ModelCard) -> None:
    """A delete and an out-of-band response sent while a response runs wait, in order with an item
    between them: the delete runs when the response is done, the item joins behind it, and the
    out-of-band response starts once the delete is in (every seq increasing). Refusals of what can
    be known at once come at once; the rest when the edit runs, naming its event."""
    h, _last = _talked(card)
    ids = _ids(h)
    (running,) = h.send({"type": "response.create"}).messages
    assert isinstance(running, InputChunk)
    (refused,) = h.reply({"type": "conversation.item.delete", "item_id": "nope", "event_id": "x"})
    assert refused["error"]["code"] == "item_not_found"
    for event in (
        {"type": "conversation.item.delete", "item_id": ids[2], "event_id": "d1"},
        user("Later"),
        {"type": "conversation.item.delete", "item_id": ids[2], "event_id": "d2"},  # gone by then
        {"type": "response.create", "event_id": "o", "response": {"conversation": "none"}},
    ):
        decoded = h.send(event)
        assert decoded.messages == () and decoded.replies == ()

    ended = _reply(h, running.seq, "Fine", 31)
    assert types(ended)[-2:] == ["response.done", "conversation.item.added"]  # "Later" joined
    deleting = h.dialect.take_released()
    assert deleting[0] == SessionRewind(to_seq=_last["Hello"])
    seqs = [m.seq for m in deleting if isinstance(m, InputChunk)]
    assert seqs == sorted(seqs) and seqs[0] > running.seq
    remaining = [*TALK[:2], TALK[3], {"role": "assistant", "content": "Fine"}]
    later = {"role": "user", "content": "Later"}
    kept = _render(card, TALK[:1], prompt=True) + "Hello<|im_end|>"  # the reply's turn, its stop token
    assert texts(deleting[1:]) == _render(card, [*remaining, later])[len(kept) :]

    after = _answer(h, deleting)
    assert "conversation.item.deleted" in types(after)
    (second,) = [e for e in after if e["type"] == "error"]
    assert second["error"]["code"] == "item_not_found" and second["error"]["event_id"] == "d2"
    assert "response.created" in types(after)  # the out-of-band response, now
    flush, header = h.dialect.take_released()
    assert isinstance(flush, InputChunk) and flush.flush and flush.seq > seqs[-1]
    assert isinstance(header, InputChunk) and header.text == "<|im_start|>assistant\n"
    assert [item.text for item in _conversation(h).items] == ["Hi", "Hello", "Sure", "Fine", "Later"]


# ---- tool items (#36) deleted and sent again ----------------------------------------------------

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = call_text("get_weather", '{"city": "Paris"}')


class _Session:
    """What a session's KV holds, as text: each conversation chunk's text by seq (a response's with
    its reply and stop token), cut back by rewinds, after the open's kept prefix."""

    def __init__(self) -> None:
        self.prefix = ""
        self.chunks: dict[int, str] = {}

    def take(self, messages: tuple[ClientMessage, ...] | list[ClientMessage]) -> None:
        for message in messages:
            if isinstance(message, SessionOpen):
                self.prefix = message.config.keep_prefix_text or ""
            elif isinstance(message, SessionRewind):
                to = -1 if message.to_seq is None else message.to_seq
                self.chunks = {seq: text for seq, text in self.chunks.items() if seq <= to}
            elif isinstance(message, InputChunk):
                self.chunks[message.seq] = message.text or ""

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.chunks[seq] for seq in sorted(self.chunks))


def _tool_talk(card: ModelCard) -> tuple[Harness, _Session, list[str]]:
    """A user message, a reply of text and a call (`auto`), the call's output, a reply: every
    chunk answered. Returns the items' ids: user, reply text, call, output, reply."""
    h, kv = Harness(card), _Session()
    session = {"type": "realtime", "instructions": "Be brief.", "tools": [WEATHER], "tool_choice": "auto"}
    h.reply({"type": "session.update", "session": session})
    sent = h.send(user("Weather in Paris?")).messages
    kv.take(sent)
    _answer(h, sent)

    def respond(pieces: list[str], token: int) -> list[dict[str, Any]]:
        (chunk,) = h.send({"type": "response.create"}).messages
        assert isinstance(chunk, InputChunk)
        kv.take([chunk])
        for index, piece in enumerate(pieces):
            h.encode(OutputDelta(chunk.seq, index, token + index, piece))
        h.encode(OutputDelta(chunk.seq, len(pieces), EOS, "<|im_end|>"))
        kv.chunks[chunk.seq] += "".join(pieces) + "<|im_end|>"
        return h.encode(done(chunk.seq, (token, EOS), "stop"))

    closing = respond(["Let me see.", CALL[:9], CALL[9:]], 40)
    call = closing[-1]["response"]["output"][1]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    sent = h.send({"type": "conversation.item.create", "item": output}).messages
    kv.take(sent)
    _answer(h, sent)
    respond(["It is sunny."], 50)
    return h, kv, _ids(h)


def _tool_messages(without: str = "") -> list[dict[str, str]]:
    """`_tool_talk`'s conversation as the template is given it, less one item's part."""
    system = {"role": "system", "content": system_content("Be brief.", (TOOL,))}
    reply = ("" if without == "text" else "Let me see.") + ("" if without == "call" else CALL)
    messages = [
        system,
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": output_content("sunny")},
        {"role": "assistant", "content": "It is sunny."},
    ]
    gone = {"user": 1, "output": 3}.get(without)
    return [m for i, m in enumerate(messages) if i != gone]


TOOL = FunctionTool("get_weather", WEATHER["description"], WEATHER["parameters"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("index", "without"), [(0, "user"), (1, "text"), (2, "call"), (3, "output")])
def test_deleting_an_item_among_tool_items_leaves_the_kv_as_the_conversation_without_it(
    card: ModelCard, index: int, without: str
) -> None:
    """A message before tool items, a reply's text (its call stays: the assistant message is the
    call alone), its call (the message is its text alone; the call's output stays, the same tool
    message), the output: the KV then holds the template's rendering of the conversation without
    the item, and the next item appends after it exactly. The items left keep their ids, call ids
    and statuses; `conversation.item.deleted` comes once the last chunk is in."""
    h, kv, ids = _tool_talk(card)
    conversation = _conversation(h)
    kept = [(i.item_id, i.type, i.call_id, i.status, i.text, i.arguments) for i in conversation.items]
    assert kv.text + "\n" == _render(card, _tool_messages())  # the reply's end marker's newline is owed
    messages = h.send({"type": "conversation.item.delete", "item_id": ids[index]}).messages
    kv.take(messages)
    assert types(_answer(h, messages)) == ["conversation.item.deleted"]
    assert kv.text == _render(card, _tool_messages(without))
    assert [(i.item_id, i.type, i.call_id, i.status, i.text, i.arguments) for i in conversation.items] == [
        k for k in kept if k[0] != ids[index]
    ]
    sent = h.send(user("Next")).messages
    kv.take(sent)
    assert kv.text == _render(card, [*_tool_messages(without), {"role": "user", "content": "Next"}])
    # The call's id still names a call once its item is sent again; a deleted call's does not.
    call_id = kept[2][2]
    again = h.reply(
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": call_id, "output": "x"},
        }
    )
    assert again[0]["type"] == ("error" if without == "call" else "conversation.item.added"), again


def test_a_reply_cut_inside_its_call_is_sent_again_as_generated(card: ModelCard) -> None:
    """A call cut short is `incomplete` and lacks its end: what the reply's items spell is still the
    reply as generated, held-back text and all."""
    h, kv = Harness(card), _Session()
    session = {"type": "realtime", "tools": [WEATHER], "tool_choice": "auto"}
    h.reply({"type": "session.update", "session": session})
    for event in (user("First"), user("Weather?")):
        sent = h.send(event).messages
        kv.take(sent)
        _answer(h, sent)
    (chunk,) = h.send({"type": "response.create"}).messages
    assert isinstance(chunk, InputChunk)
    kv.take([chunk])
    cut = "Hm <" + CALL[:-6]  # text that could start a call, then a call cut inside its end
    for index, piece in enumerate([cut[:4], cut[4:20], cut[20:]]):
        h.encode(OutputDelta(chunk.seq, index, 40 + index, piece))
    kv.chunks[chunk.seq] += cut
    closing = h.encode(done(chunk.seq, (40, 41, 42), "length"))
    assert [o["status"] for o in closing[-1]["response"]["output"]] == ["completed", "incomplete"]
    items = _conversation(h).items
    assert [i.status for i in items[-2:]] == ["completed", "incomplete"]
    assert "".join(i.written for i in items[-2:]) == cut
    messages = h.send({"type": "conversation.item.delete", "item_id": items[0].item_id}).messages
    kv.take(messages)
    _answer(h, messages)
    system = {"role": "system", "content": system_content(None, (TOOL,))}
    remaining = [system, {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": cut}]
    assert _render(card, remaining).startswith(kv.text)  # the end marker is owed to the next append
    kv.take(h.send(user("Next")).messages)
    assert kv.text == _render(card, [*remaining, {"role": "user", "content": "Next"}])


def test_an_out_of_band_response_over_copies_of_tool_items(card: ModelCard) -> None:
    """Input: the user message, the reply's text and the call's output (the references leave the
    conversation inside the reply): the session goes back to before the reply; the copies render as
    a conversation of those items would (the reply's text alone as its message, the output as its
    tool message); afterwards the conversation is sent again whole."""
    h, kv, ids = _tool_talk(card)
    refs = [{"type": "item_reference", "id": ids[i]} for i in (0, 1, 3)]
    messages = _out_of_band(h, refs)
    asked = max(seq for seq, text in kv.chunks.items() if "Weather in Paris?" in text)
    assert messages[0] == SessionRewind(to_seq=asked)  # back to before the reply
    kv.take(messages)
    kept = [m for m in _tool_messages("call") if m["content"] != "It is sunny."]
    assert kv.text == _render(card, kept, prompt=True)
    last = messages[-1]
    assert isinstance(last, InputChunk)
    h.encode(SessionRewound(3))
    h.encode(done(last.seq, (30,), "length"))
    restore = h.dialect.take_released()
    kv.take(restore)
    assert kv.text == _render(card, _tool_messages())
    assert _ids(h) == ids
    _answer(h, restore)
    # Copies of a call and its output alone: the call is an assistant message of its own.
    messages = _out_of_band(h, [{"type": "item_reference", "id": ids[i]} for i in (2, 3)])
    kv.take(messages)
    system, output = _tool_messages()[0], _tool_messages()[3]
    assert kv.text == _render(card, [system, {"role": "assistant", "content": CALL}, output], prompt=True)
