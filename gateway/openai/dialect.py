"""`OpenAIDialect`: one OpenAI Realtime socket translated to and from a microturn session.

How events map (docs/protocol.md "OpenAI Realtime dialect"):
- the greeting is a native `ping`; its `pong` is encoded as `session.created`, so that comes first;
- the native session opens lazily, right before the first chunk, so `session.update` may still set
  the sampling first; its config names the socket's model, so placement picks a worker serving it;
- `conversation.item.create` -> text chunks of at most `PIECE_CHARS` characters that ask for no
  output (the item's rendering, conversation.py); `conversation.item.done` once the last is in;
- `response.create` -> one chunk with the assistant header that asks for `max_output_tokens`;
  its deltas -> `response.output_text.delta`, its done -> the closing events and `response.done`;
- `response.cancel` -> `output.cancel`;
- `conversation.item.delete` -> `session.rewind` to the item, then what followed again
  (item_delete.py); `response.create` with `conversation: "none"` -> a flush, the response's
  chunks, then `session.rewind` back to the flush (out_of_band.py);
- an item or a response asked for while a response runs is admitted at once and queued
  (pending.py); it joins when the running response ends, and its chunks are then handed to the
  session through `take_released`. What is in flight, and the queue, is flight.py's.

Every event is validated, and admitted whole (admission.py, under the session's one admission
rule), before the conversation changes; a refusal is an `error` event naming the client's
`event_id`, and the socket stays open. Should the
session still refuse a chunk (a key's daily budget, say), the conversation no longer matches the
KV: the dialect says so and refuses further items and responses rather than answer inexactly.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from gateway.dialect import Decoded, Frame, frame_size
from gateway.limits import LimitValues, SessionLimits
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from gateway.openai import item_delete, out_of_band
from gateway.openai import server_events as ev
from gateway.openai.admission import DialectLimits
from gateway.openai.calling_response import CallingResponse
from gateway.openai.client_events import (
    ClientEvent,
    ItemCreate,
    ItemDelete,
    ItemRetrieve,
    ItemTruncate,
    ResponseCancel,
    ResponseCreate,
    parse,
)
from gateway.openai.conversation import Conversation, Item
from gateway.openai.errors import BadEvent, RealtimeProblem, problem_from_close, problem_from_native
from gateway.openai.flight import Flight
from gateway.openai.ids import conversation_id, session_id
from gateway.openai.responses import ActiveResponse
from gateway.openai.session_config import SessionUpdate, merge_echoed
from gateway.openai.tools import ToolChoice, check_choice, constraint, parse_tool_choice, parse_tools
from gateway.openai.truncation import parse_truncation
from shared.chat_template import ChatTemplate
from shared.protocol.messages import (
    ClientMessage,
    Error,
    InputChunk,
    OpenConfig,
    OutputCancel,
    OutputDelta,
    OutputDone,
    Ping,
    Pong,
    ServerMessage,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionRewound,
)
from shared.store.models import ModelCard

logger = logging.getLogger(__name__)

DIALECT_NAME: Final = "openai"
_GREETING: Final = "openai.session.created"


class OpenAIDialect:
    """Stateful per socket; `decode` and `encode` are called from the socket's reader and writer."""

    def __init__(
        self,
        card: ModelCard,
        limits: DialectLimits,
        values: LimitValues,
        metrics: GatewayMetrics | None = None,
        *,
        instructions: str | None = None,
        max_output_tokens: int | None = None,
        echoed: Mapping[str, Any] | None = None,
    ) -> None:
        self._card = card
        self._limits = limits
        self._values = values  # the gateway's limits: an item's size is bounded by its queue
        self._metrics = metrics
        self._session_id = session_id()
        self._conversation_id = conversation_id()
        self._template = (
            ChatTemplate(card.chat_template, card.bos_token, card.eos_token) if card.chat_template else None
        )
        self._instructions = instructions or ""
        self._echoed: dict[str, Any] = dict(echoed or {})  # settings kept only to be echoed
        # session.tools and tool_choice (tools.py); a client secret's were validated when it was made.
        self._tools = parse_tools(self._echoed.get("tools") or [], "session.tools", None)
        choice = self._echoed.get("tool_choice")
        self._tool_choice: ToolChoice = "auto" if choice is None else parse_tool_choice(choice, "", None)
        self._conversation = self._new_conversation() if self._template is not None else None
        self._max_output_tokens = max_output_tokens  # None: "inf"
        self._temperature = 0.0
        # The context window (truncation.py); a client secret's settings may carry it.
        self._truncation = parse_truncation((echoed or {}).get("truncation"), None)
        self._opened = False  # a native session.open has been sent (and not failed)
        self._confirmed = False  # ... and answered: the session is open underneath
        self._dropped: set[int] = set()  # seqs sent behind an open that failed
        self._flight = Flight(self._conversation_id, self._usable)
        self._context = 0  # tokens in the session's KV as of the last done seen
        self._cached = 0  # ... as of the end of the last response: what the next one finds cached
        self._broken: str | None = None
        self._out_of_band: out_of_band.OutOfBandRun | None = None  # an out-of-band response under way
        self._deleting: item_delete.Deleting | None = None  # a conversation.item.delete under way
        # Rewinds sent (a delete's, an out-of-band response's) and not answered `session.rewound`:
        # a refusal of one leaves the KV and the conversation apart.
        self._rewinds = 0
        self._eos_ids = frozenset(card.eos_token_ids)

    # ---- the Dialect protocol -----------------------------------------------------------------

    @property
    def name(self) -> str:
        return DIALECT_NAME

    @property
    def closes_on_disconnect(self) -> bool:
        return True  # the OpenAI protocol has no resume: the session ends with its socket

    def greeting(self) -> Decoded:
        return Decoded((Ping(_GREETING),))

    def attach(self, limits: SessionLimits) -> None:
        self._flight.rule = limits

    def take_released(self) -> tuple[ClientMessage, ...]:
        return self._flight.take_released()

    def decode(self, data: Frame) -> Decoded:
        client_event_id: str | None = None
        try:
            if frame_size(data, self._limits.max_frame_bytes) > self._limits.max_frame_bytes:
                raise RealtimeProblem(
                    f"the event exceeds {self._limits.max_frame_bytes} bytes", code="string_above_max_length"
                )
            event = parse(data, max_output_tokens=self._limits.max_output_tokens)
            client_event_id = event.event_id
            decoded = self._handle(event)
            self._flight.note_sent(decoded.messages)
            return decoded
        except BadEvent as exc:
            return Decoded(replies=(ev.frame(ev.error(exc, exc.event_id)),))
        except RealtimeProblem as exc:
            return Decoded(replies=(ev.frame(ev.error(exc, client_event_id)),))

    def encode(self, message: ServerMessage) -> Sequence[Frame]:
        return [ev.frame(event) for event in self._events(message)]

    # ---- client events ------------------------------------------------------------------------

    def _handle(self, event: ClientEvent) -> Decoded:
        handlers: dict[type, Callable[..., Decoded]] = {
            SessionUpdate: self._session_update,
            ItemCreate: self._item_create,
            ResponseCreate: self._response_create,
            ResponseCancel: self._response_cancel,
            ItemDelete: self._item_delete,
            ItemTruncate: self._item_truncate,
            ItemRetrieve: self._item_retrieve,
        }
        return handlers[type(event)](event)

    def _session_view(self) -> ev.SessionView:
        return ev.SessionView(
            self._session_id, self._card.name, self._instructions, self._max_output_tokens, self._echoed
        )

    def _session_update(self, event: SessionUpdate) -> Decoded:
        if event.model is not None and event.model != self._card.name:
            raise RealtimeProblem(
                f"session.model: this session serves {self._card.name!r}; connect with ?model= for another",
                param="session.model",
            )
        if "temperature" in event.given and self._opened and event.temperature != self._temperature:
            raise RealtimeProblem(
                "session.temperature can only change before the first item or response",
                param="session.temperature",
                code="unsupported_value",
            )
        if "truncation" in event.echoed and self._opened and event.truncation != self._truncation:
            raise RealtimeProblem(
                "session.truncation can only change before the first item or response",
                param="session.truncation",
                code="unsupported_value",
            )
        tools = self._tools if event.tools is None else event.tools
        choice = self._tool_choice if event.tool_choice is None else event.tool_choice
        check_choice(choice, tools, "session.tool_choice")
        if event.tools is not None:
            self._need_conversation().set_tools(tools)  # raises having changed nothing
        if "instructions" in event.given:
            conversation = self._need_conversation()
            try:
                conversation.set_instructions(event.instructions or "")  # raises having changed nothing
            except RealtimeProblem:
                conversation.set_tools(self._tools)  # as it was (unchanged, or not started)
                raise
            self._instructions = event.instructions or ""
        self._tools, self._tool_choice = tools, choice
        if "max_output_tokens" in event.given:
            self._max_output_tokens = event.max_output_tokens
        if event.temperature is not None:
            self._temperature = event.temperature
        if "truncation" in event.echoed:
            self._truncation = event.truncation
        self._echoed = merge_echoed(self._echoed, event.echoed)
        return Decoded(replies=(ev.frame(ev.session_updated(self._session_view())),))

    def _item_create(self, event: ItemCreate) -> Decoded:
        messages, replies = self._flight.add_item(event)
        return self._sending(messages, replies)

    def _response_create(self, event: ResponseCreate) -> Decoded:
        limit = event.max_output_tokens or self._max_output_tokens or self._limits.max_output_tokens
        if event.out_of_band is not None:
            # An out-of-band response answers in text: a call it made would belong to no
            # conversation, so a tool_choice of its own is refused (the session's tools are still
            # in the prompt; what the model writes comes back as text).
            if event.tool_choice is not None:
                raise RealtimeProblem(
                    "response.tool_choice: an out-of-band response answers in text, without tool calls",
                    param="response.tool_choice",
                    code="unsupported_value",
                )
            conversation, oob = self._usable(), event.out_of_band
            sent, self._out_of_band = out_of_band.start(
                self._flight,
                conversation,
                oob,
                limit=limit,
                metadata=event.metadata,
                conversation_id=self._conversation_id,
            )
            return self._sending(*sent)
        choice = self._tool_choice if event.tool_choice is None else event.tool_choice
        check_choice(choice, self._tools, "response.tool_choice")
        grammar = constraint(self._tools, choice)

        def make(seq: int) -> ActiveResponse:
            if grammar is None:  # no tools, or `none`: text, as without tools
                return ActiveResponse(seq, limit, event.metadata)
            return CallingResponse(seq, limit, event.metadata, grammar)

        messages, replies = self._flight.add_response(event, make)
        return self._sending(messages, replies)

    def _sending(self, messages: list[ClientMessage], replies: list[ev.Event]) -> Decoded:
        opening: tuple[ClientMessage, ...] = ()
        if messages and not self._opened:
            opening, messages = self._open(messages)
        return Decoded(messages=(*opening, *messages), replies=tuple(ev.frame(r) for r in replies))

    def _response_cancel(self, event: ResponseCancel) -> Decoded:
        response = self._flight.response
        if response is None or (event.response_id is not None and event.response_id != response.response_id):
            raise RealtimeProblem(
                "there is no response in progress to cancel", code="response_cancel_not_active"
            )
        return Decoded(messages=(OutputCancel(response.seq),))

    def _item_delete(self, event: ItemDelete) -> Decoded:
        self._known(event.item_id)
        if self._deleting is not None or self._out_of_band is not None:
            raise RealtimeProblem(
                "conversation.item.delete waits for the delete or response under way",
                code="conversation_already_has_active_response",
            )
        kept_prefix = self._truncation.policy == "truncate" and bool(self._instructions)
        messages, self._deleting = item_delete.delete(
            self._flight, self._usable(), event.item_id, kept_prefix=kept_prefix
        )
        self._rewinds += 1
        return Decoded(messages=tuple(messages))

    def _item_truncate(self, event: ItemTruncate) -> Decoded:
        self._known(event.item_id)
        raise RealtimeProblem(
            "conversation.item.truncate: only audio can be truncated, and this model has no audio",
            param="item_id",
            code="unsupported_operation",
        )

    def _item_retrieve(self, event: ItemRetrieve) -> Decoded:
        item = self._known(event.item_id)
        retrieved = ev.item_retrieved(item.as_event("completed"))
        return Decoded(replies=(ev.frame(retrieved),))

    def _known(self, wanted: str) -> Item:
        conversation = self._need_conversation()
        found = conversation.find(wanted)
        if found is None:
            raise RealtimeProblem(
                f"no item {wanted[:64]!r} in the conversation", param="item_id", code="item_not_found"
            )
        return found

    def _need_conversation(self) -> Conversation:
        if self._conversation is None:
            raise RealtimeProblem(
                f"model {self._card.name!r} has no chat template, so it cannot hold a conversation",
                code="model_not_supported",
            )
        return self._conversation

    def _usable(self) -> Conversation:
        conversation = self._need_conversation()
        if self._broken is not None:
            raise RealtimeProblem(
                f"this conversation no longer matches the model's cache ({self._broken}); open a new session",
                code="session_inconsistent",
                kind="server_error",
            )
        return conversation

    def _open(self, messages: list[ClientMessage]) -> tuple[tuple[ClientMessage, ...], list[ClientMessage]]:
        """The native open for the first messages, and those messages. With truncation on, the
        instructions leave the first chunk for the open's `keep_prefix_text`: the session starts with
        them and keeps them across every cut (truncation.py)."""
        self._opened = True
        prefix = None
        if self._truncation.policy == "truncate" and self._conversation is not None:
            prefix = self._conversation.instructions_prefix()
            # An item's text goes out in pieces (pending.PIECE_CHARS), so long instructions (the
            # prefix cache's case) span several: the leading chunks' text together holds them.
            lead = itertools.takewhile(lambda m: isinstance(m, InputChunk) and m.text is not None, messages)
            text = "".join(m.text or "" for m in lead if isinstance(m, InputChunk))
            if prefix and len(text) > len(prefix) and text.startswith(prefix):
                messages = _strip_leading(messages, len(prefix))
            else:
                prefix = None
        config = OpenConfig(
            context_policy=self._truncation.policy,
            retention_ratio=self._truncation.retention_ratio,
            keep_prefix_text=prefix,
            max_output_tokens=0,
            temperature=self._temperature,
            stream=True,
            model=self._card.name,
            idle_timeout_s=self._limits.idle_timeout_s,
        )
        return (SessionOpen(config),), messages

    # ---- session messages ---------------------------------------------------------------------

    def _events(self, message: ServerMessage) -> list[ev.Event]:
        if isinstance(message, Pong) and message.data == _GREETING:
            created = [ev.session_created(self._session_view())]
            if self._limits.rate_limits:
                created.append(ev.rate_limits_updated(self._limits.rate_limits))
            return created
        if isinstance(message, SessionOpened):
            self._confirmed = True
            if self._metrics is not None:
                self._metrics.count(Metric.DIALECT_SESSIONS, label=DIALECT_NAME)
            logger.info("openai session %s is microturn session %s", self._session_id, message.session_id)
            return []
        if isinstance(message, OutputDelta):
            return self._delta(message)
        if isinstance(message, OutputDone):
            return self._done(message)
        if isinstance(message, Error):
            return self._error(message)
        if isinstance(message, SessionRewound):  # a delete's or an out-of-band response's
            self._rewinds = max(self._rewinds - 1, 0)
            self._context = self._cached = message.length
            deleting = self._deleting
            if deleting is not None and deleting.last_seq is None:
                self._deleting = None
                return [ev.item_deleted(deleting.item_id)]
            return []
        if isinstance(message, SessionClosed):
            problem = problem_from_close(message.reason)
            return [] if problem is None else [ev.error(problem)]
        return []  # restored, resumed, expiring, closed: nothing an OpenAI client has a name for

    def _delta(self, delta: OutputDelta) -> list[ev.Event]:
        response = self._flight.response
        if response is None or delta.seq != response.seq:
            return []
        return response.on_delta(delta, self._eos_ids)

    def _done(self, done: OutputDone) -> list[ev.Event]:
        self._flight.settle((done.seq,))
        if self._out_of_band is not None and done.seq in self._out_of_band.chunks:
            return self._out_of_band_done(done, self._out_of_band)
        deleting = self._deleting
        if deleting is not None and done.seq == deleting.last_seq:
            self._deleting = None
            self._context += (done.committed_tokens or 0) + len(done.tokens)
            return [ev.item_deleted(deleting.item_id)]
        self._context += (done.committed_tokens or 0) + len(done.tokens)
        piece = self._flight.item_chunks.pop(done.seq, None)
        if piece is not None:
            item_id_, last = piece
            item = self._conversation.find(item_id_) if self._conversation is not None else None
            if not last or item is None:
                return []
            index = self._conversation.items.index(item) if self._conversation is not None else 0
            previous = self._conversation.items[index - 1].item_id if index and self._conversation else None
            return [ev.item_done(item.as_event("completed"), previous)]
        response = self._flight.response
        if response is None or done.seq != response.seq:
            return []
        return self._finish(response, done)

    def _finish(self, response: ActiveResponse, done: OutputDone) -> list[ev.Event]:
        self._flight.response = None
        conversation = self._conversation
        assert conversation is not None
        outcome = response.outcome(done, self._eos_ids)
        previous = conversation.last_item_id
        events: list[ev.Event] = []
        try:
            conversation.finish_response(
                outcome.reply, outcome.stop_text, response.item_id, outcome.item_status, response.shown()
            )
        except RealtimeProblem as exc:
            self._broken = exc.message
            events.append(ev.error(exc))
        # Input: the whole context the reply was sampled after; cached: what the previous
        # response left in the KV (the tokens this turn did not have to prefill again).
        usage = ev.Usage(self._context - len(done.tokens), self._cached, len(done.tokens))
        self._cached = self._context
        if self._metrics is not None:
            self._metrics.count(Metric.DIALECT_TURNS, label=DIALECT_NAME)
        return (
            events + response.closing(self._conversation_id, outcome, usage, previous) + self._flight.join()
        )

    def _out_of_band_done(self, done: OutputDone, run: out_of_band.OutOfBandRun) -> list[ev.Event]:
        """An out-of-band response's chunk is done; at its last, the conversation goes back to
        where it was and the session is rewound there, ahead of any input that waited."""
        run.inputs += done.committed_tokens or 0
        if done.seq != run.response.seq:
            return []
        self._out_of_band, self._flight.response = None, None
        assert self._conversation is not None
        self._conversation.rollback(run.checkpoint)
        self._flight.release(run.rewind())
        self._rewinds += 1
        outcome = run.response.outcome(done, self._eos_ids)
        usage = ev.Usage(self._context + run.inputs, self._context, len(done.tokens))
        closing = run.response.closing(self._conversation_id, outcome, usage, None)
        return out_of_band.without_conversation(closing) + self._flight.join()

    def _out_of_band_refused(self, error: Error, run: out_of_band.OutOfBandRun) -> list[ev.Event]:
        """A chunk of an out-of-band response was refused (the ones behind it will be too): the
        response fails, and what of it reached the session is rewound."""
        self._out_of_band, self._flight.response = None, None
        assert self._conversation is not None
        self._conversation.rollback(run.checkpoint)
        if error.seq != run.flush_seq:
            self._flight.release(run.rewind())
            self._rewinds += 1
        assert error.seq is not None
        self._dropped.update(s for s in run.chunks if s > error.seq)  # refused behind it: told here
        problem = problem_from_native(error, "the out-of-band response was refused")
        failed = run.response.failed(self._conversation_id, problem)
        return out_of_band.without_conversation(failed) + self._flight.join()

    def _error(self, error: Error) -> list[ev.Event]:
        if error.seq is None and self._rewinds and not error.fatal:
            # The session refused a rewind (a delete's item is gone from the window or too old;
            # the session was moving): the conversation here was already edited, so it no longer
            # matches the KV. Said once; further items and responses are refused.
            self._rewinds -= 1
            self._deleting = None
            problem = problem_from_native(error, "the conversation could not be edited")
            self._broken = problem.message
            return [ev.error(problem)]
        if error.seq is None:
            problem = problem_from_native(error)
            if self._opened and not self._confirmed and not error.fatal:
                return [ev.error(self._open_failed(problem))]
            return [ev.error(problem)]
        self._flight.settle((error.seq,))
        run = self._out_of_band
        if run is not None and (error.seq in run.chunks or error.seq == run.flush_seq):
            return self._out_of_band_refused(error, run)
        if error.seq in self._dropped:
            self._dropped.discard(error.seq)  # refused because the open failed: already reported
            return []
        events = []
        response = self._flight.response
        if response is not None and error.seq == response.seq:
            self._flight.response = None
            problem = problem_from_native(error, "the response was refused")
            if error.seq == self._flight.sent_seq and self._conversation is not None:
                self._conversation.abandon_response()  # nothing of it reached the KV
            else:
                self._broken = problem.message
            return response.failed(self._conversation_id, problem) + self._flight.join()
        piece = self._flight.item_chunks.pop(error.seq, None)
        problem = problem_from_native(error, "a piece of an item was refused" if piece else None)
        if piece is not None:
            self._broken = problem.message
        events.append(ev.error(problem))
        return events

    def _open_failed(self, problem: RealtimeProblem) -> RealtimeProblem:
        """The lazy open was refused: the chunks sent behind it will be refused too; start afresh."""
        self._opened = False
        self._dropped.update(self._flight.item_chunks)
        self._flight.item_chunks.clear()
        if self._flight.response is not None:
            self._dropped.add(self._flight.response.seq)
            self._flight.response = None
        self._flight.drop_queued()  # sent behind the open: as if never sent
        if self._conversation is not None:
            self._conversation = self._new_conversation()
        return RealtimeProblem(
            f"the session could not be opened ({problem.message}); the conversation is empty: send its "
            "items again",
            code=problem.code,
            kind=problem.kind,
        )

    def _new_conversation(self) -> Conversation:
        assert self._template is not None
        conversation = Conversation(self._template, self._values.max_queued_tokens)
        if self._instructions:
            conversation.set_instructions(self._instructions)
        conversation.set_tools(self._tools)
        return conversation


def _strip_leading(messages: list[ClientMessage], chars: int) -> list[ClientMessage]:
    """The messages with their first `chars` characters of chunk text taken out (the open keeps
    them); a chunk emptied whole stays, with no text, so every seq is still sent in order."""
    stripped: list[ClientMessage] = []
    for message in messages:
        if chars and isinstance(message, InputChunk) and message.text is not None:
            taken = min(chars, len(message.text))
            stripped.append(replace(message, text=message.text[taken:]))
            chars -= taken
        else:
            stripped.append(message)
    return stripped
