"""The OpenAI dialect's edits (issue #35) as a Sans-I/O translator: an out-of-band response over
other items than the conversation's, deleting the first item under a kept prefix, and deletes and
out-of-band responses sent while something is in flight. Each checks the text the session is
given against the chat template's rendering of the conversation whole (what makes later turns
exact), and the order of what goes to the session."""

from __future__ import annotations

from typing import Any

from gateway.openai.conversation import Conversation
from shared.protocol.messages import ClientMessage, InputChunk, OutputDelta, SessionRewind, SessionRewound
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
