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
  (item_delete.py, resend.py); `response.create` with `conversation: "none"` -> a flush, the
  response's chunks, then `session.rewind` back to the flush; or, over other items than the
  conversation's, a rewind, the response, a rewind and the conversation's items again
  (out_of_band.py);
- an item or a response asked for while a response runs is admitted at once and queued
  (pending.py); it joins when the running response ends, and its chunks are then handed to the
  session through `take_released`. A delete or an out-of-band response that must rewind waits, in
  the same queue, until the session is idle (`_advance`). What is in flight, and the queue, is
  flight.py's;
- a session whose instructions are its kept prefix opens with an empty chunk of its own (seq
  `MARKER_SEQ`) that ends where they end: what deleting the first item goes back to (resend.py).

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
from gateway.limits import ChunkCost, LimitValues, SessionLimits
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
    ItemReference,
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
from gateway.openai.pending import QueuedEdit
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
# The seq of the empty chunk a session with a kept prefix opens with: below every seq the flight
# gives out (from 1), so it always goes first.
MARKER_SEQ: Final = 0


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
        self._marker = False  # MARKER_SEQ is admitted for the open (a kept prefix is due)
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
        self._admit_marker()
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
            # Over the whole conversation it only appends (then rewinds), so it starts as soon as
            # no response runs; over other items it rewinds first, so it waits for the session to
            # be idle (`_advance`), as a delete does.
            if self._flight.busy or (not self._flight.idle and not out_of_band.appends(conversation, oob)):
                for index, entry in enumerate(oob.input or ()):
                    if isinstance(entry, ItemReference):
                        self._will_exist(entry.item_id, f"response.input[{index}].id")
                self._flight.queue_edit(event, self._values.chunk_burst)
                return Decoded()
            return self._sending(*self._start_out_of_band(event, None))
        self._admit_marker()
        choice = self._tool_choice if event.tool_choice is None else event.tool_choice
        check_choice(choice, self._tools, "response.tool_choice")
        grammar = constraint(self._tools, choice)

        def make(seq: int) -> ActiveResponse:
            if grammar is None:  # no tools, or `none`: text, as without tools
                return ActiveResponse(seq, limit, event.metadata)
            return CallingResponse(seq, limit, event.metadata, grammar)

        messages, replies = self._flight.add_response(event, make)
        return self._sending(messages, replies)

    def _start_out_of_band(
        self, event: ResponseCreate, first_seq: int | None
    ) -> tuple[list[ClientMessage], list[ev.Event]]:
        assert event.out_of_band is not None
        limit = event.max_output_tokens or self._max_output_tokens or self._limits.max_output_tokens
        sent, self._out_of_band = out_of_band.start(
            self._flight,
            self._usable(),
            event.out_of_band,
            limit=limit,
            metadata=event.metadata,
            conversation_id=self._conversation_id,
            first_seq=first_seq,
        )
        return sent

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
        if self._flight.busy or not self._flight.idle:
            # It waits for what is in flight (its rewind must cancel no turn), in order with the
            # input around it; an item that will not be there by then is refused now.
            self._will_exist(event.item_id, "item_id")
            self._usable()
            self._flight.queue_edit(event, self._values.chunk_burst)
            return Decoded()
        self._known(event.item_id)
        messages, _replies = self._delete(event, None)
        return Decoded(messages=tuple(messages))

    def _delete(self, event: ItemDelete, first_seq: int | None) -> tuple[list[ClientMessage], list[ev.Event]]:
        kept_prefix = self._truncation.policy == "truncate" and bool(self._instructions) and not self._marker
        messages, self._deleting = item_delete.delete(
            self._flight, self._usable(), event.item_id, kept_prefix=kept_prefix, first_seq=first_seq
        )
        return messages, []

    def _will_exist(self, wanted: str, param: str) -> None:
        """Refuse an item that is neither in the conversation nor joining it before a queued event
        runs (an item queued, the running or a queued response's reply)."""
        conversation = self._need_conversation()
        joining = {self._flight.response.item_id} if self._flight.response is not None else set()
        joining |= self._flight.pending.item_ids | self._flight.pending.reply_ids
        if conversation.find(wanted) is None and wanted not in joining:
            raise RealtimeProblem(
                f"no item {wanted[:64]!r} in the conversation", param=param, code="item_not_found"
            )

    def _advance(self) -> list[ev.Event]:
        """Queued input joins up to the next response; an edit at the head of the queue runs once
        the session is idle (every chunk and rewind before it answered), as if it arrived then, under
        the seqs reserved for it. A refusal then is an `error` naming its event, and changes nothing."""
        events = self._flight.join()
        while isinstance(edit := self._flight.pending.head, QueuedEdit) and self._flight.idle:
            self._flight.pending.pop()
            try:
                if isinstance(edit.event, ItemDelete):
                    messages, replies = self._delete(edit.event, edit.first_seq)
                else:
                    messages, replies = self._start_out_of_band(edit.event, edit.first_seq)
            except RealtimeProblem as exc:
                events.append(ev.error(exc, edit.event_id))
            else:
                self._flight.release(*messages)
                events += replies
            events += self._flight.join()
        return events

    def _admit_marker(self) -> None:
        """Before the first item or response of a session whose instructions will be its kept
        prefix: the open's marker chunk is admitted first, with nothing in flight (never refused)."""
        if self._opened or self._marker or self._conversation is None:
            return
        if self._truncation.policy != "truncate" or self._conversation.instructions_prefix() is None:
            return
        self._flight.admit([ChunkCost(MARKER_SEQ, 0, False)], "item")
        self._marker = True
        self._flight.conversation_seq = MARKER_SEQ

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
        them and keeps them across every cut (truncation.py); the marker chunk (`_admit_marker`)
        goes first, ending where they end."""
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
                self._conversation.pin_instructions(prefix)
            else:
                prefix = None
        if self._marker:  # flushing: a rewind to it leaves no text held back
            messages = [InputChunk(MARKER_SEQ, text="", max_output_tokens=0, flush=True), *messages]
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
            return self._done(message) + self._advance()
        if isinstance(message, Error):
            return self._error(message) + self._advance()
        if isinstance(message, SessionRewound):  # a delete's or an out-of-band response's
            return self._rewound(message) + self._advance()
        if isinstance(message, SessionClosed):
            problem = problem_from_close(message.reason)
            return [] if problem is None else [ev.error(problem)]
        return []  # restored, resumed, expiring, closed: nothing an OpenAI client has a name for

    def _rewound(self, message: SessionRewound) -> list[ev.Event]:
        self._flight.rewinds = max(self._flight.rewinds - 1, 0)
        self._context = self._cached = message.length
        deleting = self._deleting
        if deleting is not None and deleting.last_seq is None:
            self._deleting = None
            return [ev.item_deleted(deleting.item_id)]
        return []

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
        # Input: the whole context the reply was sampled after; cached: what the previous
        # response left in the KV (the tokens this turn did not have to prefill again).
        usage = ev.Usage(self._context - len(done.tokens), self._cached, len(done.tokens))
        self._cached = self._context
        if self._metrics is not None:
            self._metrics.count(Metric.DIALECT_TURNS, label=DIALECT_NAME)
        # Closing first: it settles a calling response's last item (the text its parser held
        # back, a call cut short as `incomplete`), so the conversation records the items as shown.
        closing = response.closing(self._conversation_id, outcome, usage, previous)
        events: list[ev.Event] = []
        try:
            conversation.finish_response(
                outcome.reply, outcome.stop_text, response.item_id, outcome.item_status, response.shown()
            )
        except RealtimeProblem as exc:
            self._broken = exc.message
            events.append(ev.error(exc))
        return events + closing

    def _out_of_band_done(self, done: OutputDone, run: out_of_band.OutOfBandRun) -> list[ev.Event]:
        """An out-of-band response's chunk is done; at its last, the session is put back under the
        conversation (a rewind, and the items it left out sent again), ahead of any input that
        waited. Usage: the session's length when it began (the conversation, or the part of it its
        input kept) is its cached input."""
        run.inputs += done.committed_tokens or 0
        if done.seq != run.response.seq:
            return []
        self._out_of_band, self._flight.response = None, None
        assert self._conversation is not None
        self._conversation.rollback(run.after)
        self._flight.release(*run.ending(self._flight))
        outcome = run.response.outcome(done, self._eos_ids)
        usage = ev.Usage(self._context + run.inputs, self._context, len(done.tokens))
        closing = run.response.closing(self._conversation_id, outcome, usage, None)
        return out_of_band.without_conversation(closing)

    def _out_of_band_refused(self, error: Error, run: out_of_band.OutOfBandRun) -> list[ev.Event]:
        """A chunk of an out-of-band response was refused (the ones behind it will be too): the
        response fails, and what of it reached the session is rewound."""
        self._out_of_band, self._flight.response = None, None
        assert self._conversation is not None
        self._conversation.rollback(run.after)
        if error.seq != run.flush_seq:  # something of it may be in the KV (or the rewind before it)
            self._flight.release(*run.ending(self._flight))
        assert error.seq is not None
        self._dropped.update(s for s in run.chunks if s > error.seq)  # refused behind it: told here
        problem = problem_from_native(error, "the out-of-band response was refused")
        failed = run.response.failed(self._conversation_id, problem)
        return out_of_band.without_conversation(failed)

    def _error(self, error: Error) -> list[ev.Event]:
        if error.seq is None and self._flight.rewinds and not error.fatal:
            # The session refused a rewind (a delete's item is gone from the window or too old):
            # the conversation here was already edited, so it no longer matches the KV. Said once;
            # further items and responses are refused. (A worker lost meanwhile is no refusal: the
            # gateway sends the rewind again where the session is restored, gateway/session/edits.py.)
            self._flight.rewinds -= 1
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
            return response.failed(self._conversation_id, problem)
        # Any other chunk is the conversation's (an item's piece, one sent again by an edit, the
        # open's marker): without it the KV no longer holds the conversation.
        piece = self._flight.item_chunks.pop(error.seq, None)
        problem = problem_from_native(error, "a piece of an item was refused" if piece else None)
        self._broken = problem.message
        self._deleting = None
        events.append(ev.error(problem))
        return events

    def _open_failed(self, problem: RealtimeProblem) -> RealtimeProblem:
        """The lazy open was refused: the chunks sent behind it will be refused too; start afresh."""
        self._opened = False
        if self._marker:
            self._dropped.add(MARKER_SEQ)
            self._marker, self._flight.conversation_seq = False, None
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
