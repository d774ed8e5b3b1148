"""The Sans-I/O core of the Python client: encoding, matching replies to requests, buffering.

Split from shared/client/clients.py so the two I/O shells there (asyncio and blocking) stay small and share
every decision: which message answers a request, what is buffered for `recv()`, which error raises
and which refusal is resent (shared/client/retry.py).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Literal, TypeVar

from websockets.exceptions import ConnectionClosed

from shared.client.retry import ChunkRetries, RetryPolicy
from shared.protocol.codec import Encoding, decode_server, encode_client
from shared.protocol.messages import (
    ClientMessage,
    CloseReason,
    Error,
    InputChunk,
    OpenConfig,
    OutputCancel,
    OutputDelta,
    OutputDone,
    Ping,
    Pong,
    ServerMessage,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionResume,
    SessionResumed,
    SessionRewind,
    SessionRewound,
)
from shared.protocol.response_format import ResponseFormat

EncodingName = Literal["json", "msgpack"]
R = TypeVar("R")

# The largest server frame a client accepts (its socket's max_size). Server frames are small; this
# only bounds a misbehaving server.
MAX_SERVER_FRAME_BYTES: Final = 16 * 2**20


class SessionClosedError(Exception):
    """The server ended the session (`session.closed`) while a request was waiting."""

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(f"session closed: {reason}")
        self.reason = reason


class ConnectionLost(Exception):
    """The socket closed without a message explaining why (the close code says what it can)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"connection closed (code {code}): {reason}")
        self.code = code
        self.reason = reason


def encoding_of(name: EncodingName | Encoding) -> Encoding:
    if isinstance(name, Encoding):
        return name
    try:
        return {"json": Encoding.JSON, "msgpack": Encoding.MSGPACK}[name]
    except KeyError:
        raise ValueError(f"encoding must be 'json' or 'msgpack', got {name!r}") from None


def open_config(**config: Any) -> OpenConfig:
    """An `OpenConfig` from keyword arguments; lists become tuples (`stop_token_ids=[]`)."""
    if config.get("stop_token_ids") is not None:
        config["stop_token_ids"] = tuple(config["stop_token_ids"])
    return OpenConfig(**config)


def lost(exc: ConnectionClosed) -> ConnectionLost:
    frame = exc.rcvd or exc.sent
    return ConnectionLost(frame.code if frame else None, frame.reason if frame else str(exc))


# ---- waiting for a reply (Sans-I/O) ---------------------------------------------------------------


class Feed(enum.Enum):
    DONE = "done"  # the awaited message: the wait is over
    MORE = "more"  # consumed by the waiter (a delta of the awaited turn); keep waiting
    NOT_MINE = "not_mine"  # someone else's: buffer it for recv()


def _raise_if_ending(msg: ServerMessage) -> None:
    if isinstance(msg, Error) and msg.fatal:
        raise msg.to_exception()
    if isinstance(msg, SessionClosed):
        raise SessionClosedError(msg.reason)


class ReplyWaiter:
    """Waits for a message of one type (`session.opened`, `pong`, ...); an `error` without a seq
    is the request's failure."""

    def __init__(self, want: type[ServerMessage]) -> None:
        self.want = want
        self.result: ServerMessage | None = None

    def feed(self, msg: ServerMessage) -> Feed:
        if isinstance(msg, self.want):
            self.result = msg
            return Feed.DONE
        if isinstance(msg, Error) and msg.seq is None:
            raise msg.to_exception()
        _raise_if_ending(msg)
        return Feed.NOT_MINE


class TurnWaiter:
    """Collects the deltas of turn `seq` until its `output.done`; its `error` raises, unless
    `retries` says to resend the chunk: then the wait ends with `retry_in` set (seconds)."""

    def __init__(self, seq: int, retries: ChunkRetries | None = None) -> None:
        self.seq = seq
        self.retries = retries
        self.deltas: list[OutputDelta] = []
        self.result: OutputDone | None = None
        self.retry_in: float | None = None

    def feed(self, msg: ServerMessage) -> Feed:
        if isinstance(msg, OutputDelta) and msg.seq == self.seq:
            self.deltas.append(msg)
            return Feed.MORE
        if isinstance(msg, OutputDone) and msg.seq == self.seq:
            self.result = msg
            if self.retries is not None:
                self.retries.answered(self.seq)
            return Feed.DONE
        if isinstance(msg, Error) and msg.seq == self.seq:
            if self.retries is not None:
                self.retry_in = self.retries.delay_for(msg)
                if self.retry_in is not None:
                    return Feed.DONE
                self.retries.answered(self.seq)
            raise msg.to_exception()
        _raise_if_ending(msg)
        return Feed.NOT_MINE


Waiter = ReplyWaiter | TurnWaiter


@dataclass(frozen=True, slots=True)
class Request(Generic[R]):
    """One request's whole flow, for an I/O shell to run: send `message` (if any), feed `waiter`
    until it is done, then `finish()` gives the answer (and updates the core's session state)."""

    message: ClientMessage | None
    waiter: Waiter
    finish: Callable[[], R]


class ClientCore:
    """Encoding, decoding, the buffer of messages nobody has asked for yet, and every request's
    flow (`open`, `resume`, `ping`, `chunk`, `turn`, `close`): the shells only move bytes and wait."""

    def __init__(self, encoding: Encoding, retry: RetryPolicy | None = None) -> None:
        self.encoding = encoding
        self.buffer: deque[ServerMessage] = deque()
        self.retries = ChunkRetries(retry or RetryPolicy())
        self.session_id: str | None = None
        self.resume_token: str | None = None
        # The deltas of the last awaited turn (empty unless the session streams).
        self.last_deltas: list[OutputDelta] = []

    # ---- requests -----------------------------------------------------------------------------

    def open(self, config: OpenConfig) -> Request[SessionOpened]:
        waiter = ReplyWaiter(SessionOpened)

        def finish() -> SessionOpened:
            opened = _answer(waiter, SessionOpened)
            self.session_id, self.resume_token = opened.session_id, opened.resume_token
            return opened

        return Request(SessionOpen(config), waiter, finish)

    def resume(self, session_id: str, resume_token: str, last_seq: int | None) -> Request[SessionResumed]:
        waiter = ReplyWaiter(SessionResumed)

        def finish() -> SessionResumed:
            resumed = _answer(waiter, SessionResumed)
            self.session_id, self.resume_token = session_id, resume_token
            return resumed

        return Request(SessionResume(session_id, resume_token, last_seq), waiter, finish)

    def ping(self, data: object) -> Request[Pong]:
        waiter = ReplyWaiter(Pong)
        return Request(Ping(data), waiter, lambda: _answer(waiter, Pong))

    def close(self) -> Request[SessionClosed]:
        waiter = ReplyWaiter(SessionClosed)
        return Request(SessionClose(), waiter, lambda: _answer(waiter, SessionClosed))

    def chunk(self, chunk: InputChunk) -> InputChunk:
        """A chunk about to be sent: kept until answered, so a refusal can resend it."""
        self.retries.sent(chunk)
        return chunk

    def cancel(self, seq: int) -> OutputCancel:
        return OutputCancel(seq)

    def rewind(self, message: SessionRewind | OutputCancel) -> Request[SessionRewound]:
        """`session.rewind`, or `output.cancel` keeping k outputs: answered by `session.rewound`."""
        waiter = ReplyWaiter(SessionRewound)
        return Request(message, waiter, lambda: _answer(waiter, SessionRewound))

    def wait_turn(self, seq: int) -> Request[OutputDone | float]:
        """Wait for turn `seq`: its `output.done`, or the seconds to wait before `resend(seq)` when
        a refusal is to be retried (then wait again)."""
        waiter = TurnWaiter(seq, self.retries)

        def finish() -> OutputDone | float:
            if waiter.retry_in is not None:
                return waiter.retry_in
            assert waiter.result is not None
            self.last_deltas = waiter.deltas
            return waiter.result

        return Request(None, waiter, finish)

    def resend(self, seq: int) -> InputChunk:
        return self.retries.resend(seq)

    # ---- frames -------------------------------------------------------------------------------

    def encode(self, msg: ClientMessage) -> str | bytes:
        return encode_client(msg, self.encoding)

    def decode(self, frame: str | bytes) -> ServerMessage:
        return decode_server(frame, self.encoding)

    def scan(self, waiter: Waiter) -> bool:
        """Offer the buffered messages to `waiter` in order; True if it finished."""
        kept: deque[ServerMessage] = deque()
        try:
            while self.buffer:
                msg = self.buffer.popleft()
                outcome = waiter.feed(msg)
                if outcome is Feed.DONE:
                    return True
                if outcome is Feed.NOT_MINE:
                    kept.append(msg)
            return False
        finally:
            kept.extend(self.buffer)
            self.buffer = kept

    def offer(self, waiter: Waiter, msg: ServerMessage) -> bool:
        outcome = waiter.feed(msg)
        if outcome is Feed.NOT_MINE:
            self.buffer.append(msg)
        return outcome is Feed.DONE


def _answer(waiter: Waiter, kind: type[R]) -> R:
    result = waiter.result
    assert isinstance(result, kind)
    return result


def chunk_message(
    seq: int,
    tokens: list[int] | tuple[int, ...] | None,
    text: str | None,
    max_output_tokens: int | None,
    logprobs: bool | None,
    *,
    flush: bool | None = None,
    response_format: ResponseFormat | None = None,
) -> InputChunk:
    tokens = None if tokens is None else tuple(tokens)
    return InputChunk(seq, tokens, text, max_output_tokens, logprobs, flush, response_format)


def handshake_headers(headers: Mapping[str, str] | None, api_key: str | None) -> dict[str, str] | None:
    """The handshake's extra headers; an API key travels as `Authorization: Bearer <key>`."""
    out = dict(headers or {})
    if api_key is not None:
        out["Authorization"] = f"Bearer {api_key}"
    return out or None
