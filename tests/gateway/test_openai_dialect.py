"""The OpenAI dialect as a Sans-I/O translator: feed client events and session messages, read the
native messages and frames. Every server event is validated with the official SDK's own pydantic
types (its `RealtimeServerEvent` union), with no field the SDK does not know."""

from __future__ import annotations

import json
from typing import Any

import gguf
import pytest
from openai.types.realtime import RealtimeServerEvent
from pydantic import BaseModel, TypeAdapter

from gateway.dialect import Decoded
from gateway.limits import LimitValues, SessionLimits
from gateway.openai.admission import DialectLimits
from gateway.openai.dialect import OpenAIDialect
from gateway.openai.pending import PIECE_CHARS
from gateway.openai.server_events import RateLimit
from shared.chat_template import ChatTemplate
from shared.errors import ErrorCode
from shared.protocol.messages import (
    Error,
    InputChunk,
    OutputCancel,
    OutputDelta,
    OutputDone,
    Ping,
    Pong,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionRewind,
    SessionRewound,
    Timing,
)
from shared.store.models import ModelCard
from worker.model.presets import smollm2_gguf_path
from worker.tokenizer.gguf import tokenizer_from_gguf

SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
EOS = 2  # SmolLM2's <|im_end|>
LIMITS = LimitValues(
    max_frame_bytes=65536,
    max_chunk_tokens=512,
    max_chunks_per_s=1000.0,
    chunk_burst=32,
    max_queued_tokens=4096,
    max_queued_outputs=8,
)


@pytest.fixture(scope="module")
def card() -> ModelCard:
    tokenizer = tokenizer_from_gguf(gguf.GGUFReader(str(smollm2_gguf_path())))
    template = tokenizer.chat_template
    assert template is not None
    assert EOS in tokenizer.eos_token_ids
    return ModelCard(
        "smollm2-135m", template.source, template.bos_token, template.eos_token, tokenizer.eos_token_ids
    )


def template_of(card: ModelCard) -> ChatTemplate:
    return ChatTemplate(card.chat_template, card.bos_token, card.eos_token)


def _no_extras(model: object) -> None:
    if isinstance(model, BaseModel):
        assert not model.model_extra, (
            f"{type(model).__name__} has fields the SDK does not know: {model.model_extra}"
        )
        for value in model.__dict__.values():
            _no_extras(value)
    elif isinstance(model, list):
        for value in model:
            _no_extras(value)


def events(frames: Any) -> list[dict[str, Any]]:
    """Each frame as an event, checked against the SDK's types."""
    out = []
    for frame in frames:
        event = json.loads(frame)
        _no_extras(SERVER_EVENT.validate_python(event))
        out.append(event)
    return out


def types(evs: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in evs]


class Harness:
    def __init__(self, card: ModelCard, limits: LimitValues = LIMITS) -> None:
        self.rule = SessionLimits(limits)  # the session's one admission rule
        self.dialect = OpenAIDialect(card, DialectLimits(512, 65536), limits)
        self.dialect.attach(self.rule)
        greeting = self.dialect.greeting()
        assert len(greeting.messages) == 1 and isinstance(greeting.messages[0], Ping)
        self.created = events(self.dialect.encode(Pong(greeting.messages[0].data)))

    def send(self, event: dict[str, Any]) -> Decoded:
        return self.dialect.decode(json.dumps(event))

    def reply(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        decoded = self.send(event)
        return events(decoded.replies)

    def encode(self, message: Any) -> list[dict[str, Any]]:
        return events(self.dialect.encode(message))


def done(seq: int, tokens: tuple[int, ...] = (), finish: str = "length", committed: int = 0) -> OutputDone:
    return OutputDone(seq, tokens, None, finish, Timing(0.0, 0.0), committed_tokens=committed)  # type: ignore[arg-type]


def texts(messages: tuple[Any, ...]) -> str:
    """The text the messages put in the session: an open's kept prefix (the instructions, with
    truncation on), then the chunks'."""
    prefix = "".join(m.config.keep_prefix_text or "" for m in messages if isinstance(m, SessionOpen))
    return prefix + "".join(m.text for m in messages if isinstance(m, InputChunk))


def user(text: str, **extra: Any) -> dict[str, Any]:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {"type": "conversation.item.create", "item": item, **extra}


def test_session_created_comes_first_and_matches_the_sdk(card: ModelCard) -> None:
    h = Harness(card)
    assert types(h.created) == ["session.created"]
    assert h.created[0]["session"]["model"] == "smollm2-135m"
    assert h.created[0]["session"]["output_modalities"] == ["text"]


def test_long_instructions_spanning_several_chunks_are_the_opens_kept_prefix(card: ModelCard) -> None:
    # An item's text goes out in 256-character chunks: instructions longer than one still become
    # the open's `keep_prefix_text` (what the prefix cache names for placement, #33, and what a
    # window cut keeps), the chunks carrying the rest, every seq still sent.
    template = template_of(card)
    instructions = " ".join(f"Rule {i}: be brief and exact." for i in range(30))
    h = Harness(card)
    h.reply({"type": "session.update", "session": {"type": "realtime", "instructions": instructions}})
    first = h.send(user("Hi!"))
    assert isinstance(first.messages[0], SessionOpen)
    system = template.render([{"role": "system", "content": instructions}])
    assert len(system) > 256 and first.messages[0].config.keep_prefix_text == system
    conversation = [{"role": "system", "content": instructions}, {"role": "user", "content": "Hi!"}]
    assert texts(first.messages) == template.render(conversation)
    # First the marker: an empty chunk ending where the kept prefix ends (what deleting the first
    # item goes back to, #35); then every seq of the item, in order.
    marker = first.messages[1]
    assert isinstance(marker, InputChunk) and (marker.seq, marker.text, marker.flush) == (0, "", True)
    seqs = [m.seq for m in first.messages[2:]]  # type: ignore[union-attr]
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) > 1


def test_two_turns_append_exactly_what_the_template_renders(card: ModelCard) -> None:
    template = template_of(card)
    h = Harness(card)
    updated = h.reply(
        {"type": "session.update", "session": {"type": "realtime", "instructions": "Be terse."}}
    )
    assert types(updated) == ["session.updated"] and updated[0]["session"]["instructions"] == "Be terse."

    first = h.send(user("Hi!", event_id="evt_1"))
    assert isinstance(first.messages[0], SessionOpen)
    assert first.messages[0].config.model == "smollm2-135m" and first.messages[0].config.stream
    # Truncation unset is OpenAI's "auto": a window cut to 0.8 of the context, instructions kept.
    opened = first.messages[0].config
    assert (opened.context_policy, opened.retention_ratio) == ("truncate", 0.8)
    assert opened.keep_prefix_text == template.render([{"role": "system", "content": "Be terse."}])
    assert types(events(first.replies)) == ["conversation.item.added"]
    assert all(m.max_output_tokens == 0 for m in first.messages[1:])  # type: ignore[union-attr]
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    assert texts(first.messages) == template.render(conversation)
    item_seq = first.messages[-1].seq  # type: ignore[union-attr]
    assert types(h.encode(SessionOpened("s", "t", "smollm2-135m"))) == []
    assert types(h.encode(done(item_seq, committed=20))) == ["conversation.item.done"]

    response = h.send({"type": "response.create", "response": {"max_output_tokens": 16}})
    assert types(events(response.replies)) == [
        "response.created",
        "conversation.item.added",
        "response.output_item.added",
        "response.content_part.added",
    ]
    (chunk,) = response.messages
    assert isinstance(chunk, InputChunk) and chunk.max_output_tokens == 16
    assert texts(first.messages) + texts(response.messages) == template.render(
        conversation, add_generation_prompt=True
    )
    out = []
    for index, (token, text) in enumerate([(10, "Hello"), (11, " there"), (EOS, "<|im_end|>")]):
        out += h.encode(OutputDelta(chunk.seq, index, token, text))
    assert [e["delta"] for e in out] == ["Hello", " there"]  # the stop token is not text
    closing = h.encode(done(chunk.seq, (10, 11, EOS), "stop", committed=3))
    assert types(closing) == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
    ]
    assert closing[0]["text"] == "Hello there"
    final = closing[-1]["response"]
    assert final["status"] == "completed"
    assert final["usage"]["input_tokens"] == 23 and final["usage"]["output_tokens"] == 3

    # Turn 2 appends only its own text: the template's text after the stop token, then the item.
    second = h.send(user("Again"))
    conversation += [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again"}]
    prompt_1 = template.render(conversation[:2], add_generation_prompt=True)
    whole = prompt_1 + "Hello there<|im_end|>" + texts(second.messages)
    assert whole == template.render(conversation)
    assert not any(isinstance(m, SessionOpen) for m in second.messages)  # the session stays open


def test_a_reply_cut_by_max_output_tokens_gets_the_end_marker(card: ModelCard) -> None:
    h = Harness(card)
    h.send(user("Count"))
    (chunk,) = h.send({"type": "response.create", "response": {"max_output_tokens": 2}}).messages
    assert isinstance(chunk, InputChunk)
    h.encode(OutputDelta(chunk.seq, 0, 10, "1"))
    h.encode(OutputDelta(chunk.seq, 1, 11, ","))
    closing = h.encode(done(chunk.seq, (10, 11), "length"))
    assert closing[-1]["response"]["status"] == "incomplete"
    assert closing[-1]["response"]["status_details"]["reason"] == "max_output_tokens"
    assert texts(h.send(user("More")).messages).startswith("<|im_end|>\n<|im_start|>user\nMore")


def test_cancel_sends_output_cancel_and_the_response_ends_cancelled(card: ModelCard) -> None:
    h = Harness(card)
    h.send(user("Talk"))
    (chunk,) = h.send({"type": "response.create"}).messages
    assert isinstance(chunk, InputChunk) and chunk.max_output_tokens == 512  # "inf": the server's most
    assert h.send({"type": "response.cancel"}).messages == (OutputCancel(chunk.seq),)
    closing = h.encode(done(chunk.seq, (10,), "cancelled"))
    assert closing[-1]["response"]["status"] == "cancelled"
    assert types(h.reply({"type": "response.cancel", "event_id": "c2"})) == ["error"]


@pytest.mark.parametrize(
    ("event", "code"),
    [
        ("not json", "invalid_json"),
        ({"type": "nope", "event_id": "e1"}, "invalid_event_type"),
        ({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "e1"}, "audio_unsupported"),
        ({"type": "conversation.item.create", "event_id": "e1"}, "missing_required_parameter"),
        (
            {
                "type": "conversation.item.create",
                "event_id": "e1",
                "item": {"type": "message", "role": "tool"},
            },
            "invalid_value",
        ),
        (
            {"type": "session.update", "event_id": "e1", "session": {"output_modalities": ["audio"]}},
            "unsupported_value",
        ),
        ({"type": "session.update", "event_id": "e1", "session": {"max_output_tokens": 0}}, "invalid_value"),
        (
            {"type": "response.create", "event_id": "e1", "response": {"conversation": "elsewhere"}},
            "invalid_value",
        ),
        (  # out of band (#35), but there is no conversation yet
            {"type": "response.create", "event_id": "e1", "response": {"conversation": "none"}},
            "unsupported_value",
        ),
        ({"type": "conversation.item.delete", "event_id": "e1", "item_id": "item_x"}, "item_not_found"),
        ({"type": "conversation.item.truncate", "event_id": "e1"}, "missing_required_parameter"),
    ],
)
def test_bad_events_get_an_error_naming_them_and_change_nothing(
    card: ModelCard, event: Any, code: str
) -> None:
    h = Harness(card)
    decoded = h.dialect.decode(event if isinstance(event, str) else json.dumps(event))
    assert decoded.messages == ()
    (error,) = events(decoded.replies)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == code
    assert error["error"]["event_id"] == (None if isinstance(event, str) else "e1")
    # The dialect still works: the next item opens the session as the first one would.
    assert isinstance(h.send(user("ok")).messages[0], SessionOpen)


def test_a_delete_waits_for_what_is_in_flight(card: ModelCard) -> None:
    """#35: a delete sent while the item's chunk is unanswered waits for it (its rewind must cancel
    no turn), then runs; an unknown item is refused at once, changing nothing."""
    h = Harness(card)
    decoded = h.send(user("keep me"))
    item_id = events(decoded.replies)[0]["item"]["id"]
    (refused,) = h.reply({"type": "conversation.item.delete", "item_id": "nope", "event_id": "x"})
    assert refused["error"]["code"] == "item_not_found" and refused["error"]["event_id"] == "x"
    waiting = h.send({"type": "conversation.item.delete", "item_id": item_id, "event_id": "d"})
    assert waiting.messages == () and waiting.replies == ()
    (retrieved,) = h.reply({"type": "conversation.item.retrieve", "item_id": item_id})
    assert retrieved["item"]["content"][0]["text"] == "keep me"
    chunk = decoded.messages[-1]
    assert isinstance(chunk, InputChunk)
    assert types(h.encode(done(chunk.seq, committed=5))) == ["conversation.item.done"]
    assert h.dialect.take_released() == (SessionRewind(keep_tokens=0),)
    assert types(h.encode(SessionRewound(0))) == ["conversation.item.deleted"]
    (gone,) = h.reply({"type": "conversation.item.retrieve", "item_id": item_id})
    assert gone["error"]["code"] == "item_not_found"


def test_an_item_too_long_for_one_event_is_refused_whole(card: ModelCard) -> None:
    h = Harness(card)
    decoded = h.send(user("x" * 5000, event_id="big"))
    assert decoded.messages == ()
    (error,) = events(decoded.replies)
    assert error["error"]["event_id"] == "big"
    ok = h.send(user("y" * 1000))
    assert isinstance(ok.messages[0], SessionOpen)  # nothing of the refused item was kept
    chunks = [m for m in ok.messages if isinstance(m, InputChunk)]
    assert len(chunks) > 1 and all(len(m.text or "") <= PIECE_CHARS for m in chunks)
    assert "x" not in texts(ok.messages)


def test_events_over_the_rate_are_refused_before_any_chunk(card: ModelCard) -> None:
    slow = LimitValues(65536, 512, 0.001, 3, 4096, 8)
    h = Harness(card, slow)
    assert len(h.send(user("a" * 600)).messages) == 4  # the open, then 3 pieces: the whole burst
    decoded = h.send(user("b", event_id="fast"))
    assert decoded.messages == ()
    assert events(decoded.replies)[0]["error"]["code"] == "rate_limit_exceeded"


def test_input_during_a_response_joins_after_it_and_its_response_follows(card: ModelCard) -> None:
    h = Harness(card)
    h.send(user("Hi"))
    (first,) = h.send({"type": "response.create"}).messages
    assert isinstance(first, InputChunk)
    # Accepted and queued: nothing reaches the session, nothing is said yet.
    queued = h.send(user("And now?", event_id="late"))
    assert queued.messages == () and queued.replies == ()
    assert h.send({"type": "response.create", "event_id": "next"}).messages == ()
    assert h.dialect.take_released() == ()
    h.encode(OutputDelta(first.seq, 0, 28, "Hello"))
    h.encode(OutputDelta(first.seq, 1, EOS, "<|im_end|>"))
    closing = h.encode(done(first.seq, (28, EOS), "stop"))
    # The running response closes, then the item joins (after the reply) and the next response opens.
    assert types(closing) == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "conversation.item.done",
        "response.done",
        "conversation.item.added",
        "response.created",
        "conversation.item.added",
        "response.output_item.added",
        "response.content_part.added",
    ]
    reply_item = closing[3]["item"]["id"]
    assert closing[5]["previous_item_id"] == reply_item
    assert closing[5]["item"]["content"][0]["text"] == "And now?"
    released = h.dialect.take_released()
    chunks = [m for m in released if isinstance(m, InputChunk)]
    assert [c.seq for c in chunks] == list(range(first.seq + 1, first.seq + 1 + len(chunks)))
    assert chunks[-1].max_output_tokens == 512 and all(c.max_output_tokens == 0 for c in chunks[:-1])
    # Exactly what the template renders after the reply; the model sampled <|im_end|> itself.
    template = template_of(card)
    before = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    after = [*before, {"role": "user", "content": "And now?"}]
    prompt = template.render(before[:1], add_generation_prompt=True)
    want = template.render(after, add_generation_prompt=True)[len(prompt + "Hello<|im_end|>") :]
    assert texts(tuple(chunks)) == want
    assert h.dialect.take_released() == ()
    item_done = h.encode(done(chunks[-2].seq, committed=5))
    assert types(item_done) == ["conversation.item.done"]


def test_input_queued_behind_a_response_is_bounded_by_the_sessions_rule(card: ModelCard) -> None:
    tight = LimitValues(65536, 512, 1000.0, 32, 600, 2)
    h = Harness(card, tight)
    h.send(user("Hi"))
    h.send({"type": "response.create"})
    assert h.send(user("a" * 300)).replies == ()  # queued: 300 + the template's share, in flight
    (refused,) = h.reply(user("b" * 300, event_id="too_much"))
    assert refused["error"]["code"] == "rate_limit_exceeded" and "retry" in refused["error"]["message"]
    assert refused["error"]["event_id"] == "too_much"
    assert h.send({"type": "response.create"}).replies == ()  # the second output allowed in flight
    (refused,) = h.reply({"type": "response.create", "event_id": "third"})
    assert refused["error"]["code"] == "rate_limit_exceeded"
    # The rule is the session's own: a native chunk would be refused by it just the same.
    with pytest.raises(Exception, match="still running"):
        h.rule.admit_chunk(999, tokens=None, text_chars=300, wants_output=False)


def test_the_agents_sdks_session_update_is_kept_echoed_and_refused_only_when_used(card: ModelCard) -> None:
    h = Harness(card)
    session = {
        "type": "realtime",
        "model": "smollm2-135m",
        "instructions": "Be brief.",
        "output_modalities": ["text"],
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "gpt-4o-mini-transcribe"},
                "turn_detection": {"type": "semantic_vad"},
                "noise_reduction": None,
            },
            "output": {"voice": "ash", "format": {"type": "audio/pcm", "rate": 24000}, "speed": 1.0},
        },
        "tools": [],
        "tool_choice": "auto",
        "tracing": "auto",
        "prompt": None,
        "include": ["item.input_audio_transcription.logprobs"],
        "truncation": "auto",
        "max_output_tokens": "inf",
    }
    (updated,) = h.reply({"type": "session.update", "session": session})
    assert updated["type"] == "session.updated"
    echo = updated["session"]
    assert echo["audio"]["output"]["voice"] == "ash" and echo["audio"]["input"]["turn_detection"] == {
        "type": "semantic_vad"
    }
    assert echo["tracing"] == "auto" and echo["truncation"] == "auto" and echo["instructions"] == "Be brief."
    assert "prompt" not in echo  # null: unset
    # A later partial update merges into audio.output and keeps the rest.
    (updated,) = h.reply({"type": "session.update", "session": {"audio": {"output": {"speed": 1.2}}}})
    assert updated["session"]["audio"]["output"] == {
        "voice": "ash",
        "format": {"type": "audio/pcm", "rate": 24000},
        "speed": 1.2,
    }
    assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    # Used, not set: audio out, an MCP tool, and a misspelt field are refused.
    for bad, code in (
        ({"output_modalities": ["audio"]}, "unsupported_value"),
        ({"tools": [{"type": "mcp", "server_label": "f"}]}, "unsupported_value"),
        ({"audio": {"output": {"volume": 3}}}, "unknown_parameter"),
        ({"tracing": 5}, "invalid_type"),
    ):
        (error,) = h.reply({"type": "session.update", "event_id": "u", "session": bad})
        assert error["error"]["code"] == code, bad
    (error,) = h.reply({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "a"})
    assert error["error"]["code"] == "audio_unsupported"


def test_a_refused_open_empties_the_conversation_and_the_next_item_reopens(card: ModelCard) -> None:
    h = Harness(card)
    first = h.send(user("Hi"))
    seq = first.messages[-1].seq  # type: ignore[union-attr]
    (error,) = h.encode(Error(ErrorCode.CAPACITY_EXHAUSTED, "no worker has room", False, retry_after_ms=1000))
    assert error["error"]["type"] == "server_error" and "send its items again" in error["error"]["message"]
    assert h.encode(Error(ErrorCode.BAD_SEQUENCE, "no session", False, seq=seq)) == []  # already reported
    again = h.send(user("Hi"))
    assert isinstance(again.messages[0], SessionOpen)
    assert texts(again.messages) == texts(first.messages)


def test_idle_timeout_is_an_error_event_before_the_close(card: ModelCard) -> None:
    h = Harness(card)
    (error,) = h.encode(SessionClosed("idle_timeout"))
    assert error["error"]["code"] == "idle_timeout"
    assert h.encode(SessionClosed("closed")) == []


def test_a_key_with_a_token_budget_gets_rate_limits_after_session_created(card: ModelCard) -> None:
    limits = DialectLimits(512, 65536, rate_limits=(RateLimit("tokens", 1000, 1000, 3600.0),))
    dialect = OpenAIDialect(card, limits, LIMITS)
    created = events(dialect.encode(Pong(dialect.greeting().messages[0].data)))  # type: ignore[union-attr]
    assert types(created) == ["session.created", "rate_limits.updated"]
    assert created[1]["rate_limits"] == [
        {"name": "tokens", "limit": 1000, "remaining": 1000, "reset_seconds": 3600.0}
    ]


@pytest.mark.parametrize(
    ("truncation", "policy", "ratio"),
    [
        ("auto", "truncate", 0.8),
        ("disabled", "error", 0.8),
        ({"type": "retention_ratio", "retention_ratio": 0.5}, "truncate", 0.5),
        (
            {"type": "retention_ratio", "retention_ratio": 1, "token_limits": {"post_instructions": 900}},
            "truncate",
            1.0,
        ),
    ],
)
def test_truncation_sets_the_sessions_window(
    card: ModelCard, truncation: Any, policy: str, ratio: float
) -> None:
    h = Harness(card)
    session = {"type": "realtime", "instructions": "Be terse.", "truncation": truncation}
    updated = h.reply({"type": "session.update", "session": session})
    assert updated[0]["session"]["truncation"] == truncation  # echoed as set
    opened = h.send(user("Hi!")).messages[0]
    assert isinstance(opened, SessionOpen)
    assert (opened.config.context_policy, opened.config.retention_ratio) == (policy, ratio)
    assert (opened.config.keep_prefix_text is not None) == (policy == "truncate")


@pytest.mark.parametrize(
    "truncation",
    [
        "sometimes",
        {"type": "retention_ratio", "retention_ratio": 0},
        {"type": "retention_ratio"},
        {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": -1}},
    ],
)
def test_a_bad_truncation_is_an_error_that_changes_nothing(card: ModelCard, truncation: Any) -> None:
    h = Harness(card)
    (error,) = h.reply({"type": "session.update", "session": {"type": "realtime", "truncation": truncation}})
    assert error["type"] == "error" and error["error"]["param"].startswith("session.truncation")
    opened = h.send(user("Hi!")).messages[0]
    assert isinstance(opened, SessionOpen) and opened.config.context_policy == "truncate"


def test_truncation_is_fixed_once_the_session_is_open(card: ModelCard) -> None:
    h = Harness(card)
    h.send(user("Hi!"))
    (error,) = h.reply({"type": "session.update", "session": {"type": "realtime", "truncation": "disabled"}})
    assert error["type"] == "error" and error["error"]["code"] == "unsupported_value"
    same = h.reply({"type": "session.update", "session": {"type": "realtime", "truncation": "auto"}})
    assert same[0]["type"] == "session.updated"


# ---- out-of-band responses (issue #35) ---------------------------------------------------------


def _talked(card: ModelCard) -> tuple[Harness, int]:
    """A harness whose conversation has a user item and a finished reply; the last seq given out."""
    h = Harness(card)
    h.send(user("Hi", event_id="u1"))
    (first,) = h.send({"type": "response.create"}).messages
    assert isinstance(first, InputChunk)
    h.encode(OutputDelta(first.seq, 0, 28, "Hello"))
    h.encode(OutputDelta(first.seq, 1, EOS, "<|im_end|>"))
    h.encode(done(first.seq, (28, EOS), "stop"))
    return h, first.seq


def test_an_out_of_band_response_answers_then_rewinds_and_adds_nothing(card: ModelCard) -> None:
    h, last = _talked(card)
    oob = {"conversation": "none", "metadata": {"topic": "summary"}, "max_output_tokens": 3}
    decoded = h.send({"type": "response.create", "response": oob})
    flush, header = decoded.messages
    assert isinstance(flush, InputChunk) and flush.flush and flush.text == "" and flush.seq == last + 1
    assert isinstance(header, InputChunk) and header.max_output_tokens == 3
    opening = events(decoded.replies)
    assert "conversation.item.added" not in types(opening)
    assert opening[0]["response"]["conversation_id"] is None
    # Input meanwhile waits, as behind any response.
    assert h.send(user("Next")).messages == ()
    h.encode(OutputDelta(header.seq, 0, 30, "Greeting"))
    closing = h.encode(done(header.seq, (30,), "length", committed=4))
    assert "conversation.item.done" not in types(closing)
    response_done = next(e for e in closing if e["type"] == "response.done")
    assert response_done["response"]["metadata"] == {"topic": "summary"}
    assert response_done["response"]["output"][0]["content"][0]["text"] == "Greeting"
    # The rewind goes first, then the item that waited, exactly as if the side answer never ran.
    released = h.dialect.take_released()
    assert released[0] == SessionRewind(to_seq=flush.seq)
    plain, _ = _talked(card)
    (*_, want) = plain.send(user("Next")).messages
    assert isinstance(want, InputChunk)
    assert texts(released[1:]) == want.text


def test_an_out_of_band_input_reuses_the_conversation_and_refuses_unknown_items(
    card: ModelCard,
) -> None:
    h, _last = _talked(card)
    conversation = h.dialect._conversation  # the ids the client was told
    assert conversation is not None
    ids = [item.item_id for item in conversation.items]
    question = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sum up"}]}
    refs = [{"type": "item_reference", "id": i} for i in ids]
    decoded = h.send(
        {"type": "response.create", "response": {"conversation": "none", "input": [*refs, question]}}
    )
    _flush, header = decoded.messages
    template = template_of(card)
    before = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    whole = template.render([*before, {"role": "user", "content": "Sum up"}], add_generation_prompt=True)
    assert isinstance(header, InputChunk) and whole.endswith(header.text) and "Sum up" in header.text
    h.encode(done(header.seq, (30,), "length", committed=9))
    assert h.dialect.take_released() == (SessionRewind(to_seq=_flush.seq),)
    for bad, code in [
        ([{"type": "item_reference", "id": "item_nope"}], "item_not_found"),
        ([refs[1], {"type": "item_reference", "id": "item_nope"}], "item_not_found"),
    ]:
        reply = h.reply(
            {"type": "response.create", "event_id": "o", "response": {"conversation": "none", "input": bad}}
        )
        assert [(e["type"], e["error"]["code"]) for e in reply] == [("error", code)]


# ---- conversation.item.delete (issue #35) -----------------------------------------------------


def _answer(h: Harness, seq: int, text: str, token: int) -> None:
    h.encode(OutputDelta(seq, 0, token, text))
    h.encode(OutputDelta(seq, 1, EOS, "<|im_end|>"))
    h.encode(done(seq, (token, EOS), "stop"))


def test_deleting_an_item_rewinds_to_it_and_sends_what_followed_again(card: ModelCard) -> None:
    h = Harness(card)
    *_, hi = h.send(user("Hi")).messages
    h.encode(done(hi.seq, committed=30))
    (first,) = h.send({"type": "response.create"}).messages
    _answer(h, first.seq, "Hello", 28)
    *_, last_piece = h.send(user("Again")).messages
    h.encode(done(last_piece.seq, committed=3))
    (second,) = h.send({"type": "response.create"}).messages
    _answer(h, second.seq, "Sure", 29)
    conversation = h.dialect._conversation
    assert conversation is not None
    ids = [item.item_id for item in conversation.items]
    template = template_of(card)
    # A middle item: back to right after the first reply, then the second reply again as text.
    decoded = h.send({"type": "conversation.item.delete", "item_id": ids[2]})
    rewind, *chunks = decoded.messages
    assert rewind == SessionRewind(to_seq=first.seq)
    remaining = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "assistant", "content": "Sure"},
    ]
    prompt = template.render(remaining[:1], add_generation_prompt=True)
    want = template.render(remaining, add_generation_prompt=False)[len(prompt + "Hello<|im_end|>") :]
    assert texts(tuple(chunks)) == want and all(c.max_output_tokens == 0 for c in chunks)
    assert [item.item_id for item in conversation.items] == [ids[0], ids[1], ids[3]]
    assert h.encode(SessionRewound(20)) == []
    assert types(h.encode(done(chunks[-1].seq, committed=6))) == ["conversation.item.deleted"]
    # The first item: the whole session goes, and what is left is sent whole.
    decoded = h.send({"type": "conversation.item.delete", "item_id": ids[0]})
    rewind, *chunks = decoded.messages
    assert rewind == SessionRewind(keep_tokens=0)
    assert texts(tuple(chunks)) == template.render(remaining[1:], add_generation_prompt=False)
    # Unknown items, and a delete while a response runs, change nothing.
    assert types(h.reply({"type": "conversation.item.delete", "item_id": "nope"})) == ["error"]


def test_a_refused_rewind_leaves_the_conversation_refusing_more(card: ModelCard) -> None:
    h, _last = _talked(card)
    decoded = h.send({"type": "response.create", "response": {"conversation": "none"}})
    _flush, header = decoded.messages
    h.encode(done(header.seq, (30,), "length", committed=4))
    assert isinstance(h.dialect.take_released()[0], SessionRewind)
    refusal = Error(ErrorCode.INVALID_MESSAGE, "session.rewind: no finished turn 3 in the history", False)
    assert types(h.encode(refusal)) == ["error"]
    (refused,) = h.reply(user("More"))
    assert refused["error"]["code"] == "session_inconsistent"
