"""The Locust load suite: each user holds one realtime session through the gateway and streams.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 20s --host ws://127.0.0.1:8000
    locust -f loadtest/locustfile.py --host ws://127.0.0.1:8000          # web UI on :8089

Every user opens a session (`session.open`, no early stop so each reply is exactly K tokens), then
sends an `input.chunk` every `--chunk-ms` on a fixed schedule (a realtime client does not slow down
because the server does), each chunk `--chunk-tokens` token ids or, with `--text`, that many words
of the text; every `--reply-every`-th chunk asks for `--reply-tokens` outputs. Each chunk is one
Locust request: named `chunk` (no output) or `reply`, `response_time` from the chunk's send to its
`output.done`; an error frame for it is a failure whose exception is the error code. An error
with `retry_after_ms` pauses the stream that long and the refused chunk is sent again (under the
next seq, up to `MAX_ATTEMPTS` sends; its request's time counts from the first), as the protocol
asks of a client; only a refusal past that is a failure. After a disconnect the user resumes its
session (`session.resume` with the last output it saw) or, if the session is gone, opens a new one.

Why gevent-specific: Locust runs users as greenlets under gevent's monkey-patching, where the
asyncio client of `shared.client.clients` cannot run; `websockets.sync.client` can. Each user has two
greenlets: its task (the paced sender) and a receiver. Only the Locust process imports this file,
so the monkey-patching never reaches a microturn process (`microturn bench --capacity` runs
Locust as a subprocess).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import time
from typing import Any, Final, cast

import gevent
from locust import User, events, task
from locust.env import Environment
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from loadtest.capacity.tracker import InFlight, Outcome
from loadtest.capacity.workload import (
    DEFAULT_CHUNK_MS,
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_REPLY_EVERY,
    DEFAULT_REPLY_TOKENS,
    ENCODINGS,
    OPEN_NAME,
    RESUME_NAME,
    SESSION_NAME,
    ChunkLoad,
)
from shared.client.core import MAX_SERVER_FRAME_BYTES, handshake_headers
from shared.errors import ErrorCode, MicroturnError
from shared.protocol.codec import decode_server, encode_client
from shared.protocol.messages import (
    ClientMessage,
    Error,
    InputChunk,
    OpenConfig,
    OutputDone,
    ServerMessage,
    SessionClose,
    SessionClosed,
    SessionOpen,
    SessionOpened,
    SessionResume,
    SessionResumed,
)

logger = logging.getLogger(__name__)

REQUEST_TYPE: Final = "ws"
# Where `--api-key` is read from when not given on the command line.
API_KEY_ENV: Final = "MT_API_KEY"
_OPEN_TIMEOUT_S: Final = 10.0
# A chunk unanswered this long is a failure (`timeout`); far beyond any latency worth measuring.
_CHUNK_TIMEOUT_S: Final = 30.0
# On stop, outputs still in flight get this long to arrive, so Locust counts what the server did.
_DRAIN_S: Final = 10.0
_RECONNECT_PAUSE_S: Final = 1.0
# A resume refused with these codes means the session no longer exists: open a new one instead.
_SESSION_GONE: Final = frozenset({ErrorCode.SESSION_NOT_FOUND.value, ErrorCode.SESSION_EXPIRED.value})


class ChunkError(Exception):
    """A failed request; its text is the protocol's error code, so Locust groups failures by code."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


def _add_options(parser: Any, **_kwargs: Any) -> None:
    parser.add_argument(
        "--chunk-ms",
        type=float,
        default=DEFAULT_CHUNK_MS,
        include_in_web_ui=True,
        help="one input.chunk every this many ms",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=DEFAULT_CHUNK_TOKENS,
        include_in_web_ui=True,
        help="tokens per chunk (words per chunk with --text)",
    )
    parser.add_argument(
        "--reply-every",
        type=int,
        default=DEFAULT_REPLY_EVERY,
        include_in_web_ui=True,
        help="every Rth chunk asks for a reply (0: never)",
    )
    parser.add_argument(
        "--reply-tokens",
        type=int,
        default=DEFAULT_REPLY_TOKENS,
        include_in_web_ui=True,
        help="output tokens per reply",
    )
    parser.add_argument(
        "--encoding",
        choices=sorted(ENCODINGS),
        default="json",
        include_in_web_ui=True,
        help="wire encoding (WebSocket subprotocol)",
    )
    parser.add_argument(
        "--text", default="", include_in_web_ui=True, help="send pieces of this text instead of token ids"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        include_in_web_ui=False,
        help=f"API key for a gateway with auth on (`microturn keys create`); env {API_KEY_ENV}",
    )


events.init_command_line_parser.add_listener(_add_options)  # type: ignore[no-untyped-call]


def load_from(environment: Environment) -> ChunkLoad:
    """The workload from Locust's options (the web UI hands values back as strings)."""
    options = environment.parsed_options
    if options is None:  # a User run from a plain Environment (a library use): the defaults
        return ChunkLoad()
    return ChunkLoad(
        chunk_ms=float(options.chunk_ms),
        chunk_tokens=int(options.chunk_tokens),
        reply_every=int(options.reply_every),
        reply_tokens=int(options.reply_tokens),
        encoding=str(options.encoding),
        text=str(options.text) or None,
    )


def api_key_from(environment: Environment) -> str | None:
    """The credential sent as `Authorization: Bearer` (None: a gateway with auth off)."""
    options = environment.parsed_options
    key = "" if options is None else str(getattr(options, "api_key", "") or "")
    return key or os.environ.get(API_KEY_ENV) or None


def realtime_url(host: str) -> str:
    host = host.rstrip("/")
    return host if host.endswith("/v1/realtime") else host + "/v1/realtime"


class RealtimeUser(User):
    """One realtime session per user, held for the whole run (see the module docstring)."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self.load = load_from(environment)
        self.api_key = api_key_from(environment)
        self.url = realtime_url(self.host or "ws://127.0.0.1:8000")
        self.inflight = InFlight()
        self.ws: ClientConnection | None = None
        self.receiver: gevent.Greenlet | None = None
        self.session_id: str | None = None
        self.resume_token = ""
        self.last_output_seq: int | None = None
        self.next_seq = 0
        self.chunks_sent = 0
        self.paused_until = 0.0
        # Chunks sent and not answered yet (what a refused one is resent from), and refused seqs
        # waiting to be resent, oldest first.
        self.unanswered: dict[int, InputChunk] = {}
        self.resend: collections.deque[int] = collections.deque()
        self.closing = False
        self.salt = random.randrange(1 << 20)

    # ---- reporting ----------------------------------------------------------------------------

    def _fire(self, outcome: Outcome) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE,
            name=outcome.name,
            response_time=outcome.response_time_ms,
            response_length=outcome.response_length,
            exception=None if outcome.error is None else ChunkError(outcome.error),
            context={"seq": outcome.seq},
        )

    def _fail(self, name: str, code: str, started: float) -> None:
        self._fire(Outcome(name, -1, (time.perf_counter() - started) * 1000.0, code))

    # ---- the socket ---------------------------------------------------------------------------

    def _send(self, message: ClientMessage) -> None:
        assert self.ws is not None
        self.ws.send(encode_client(message, self.load.wire_encoding))

    def _recv(self, timeout: float | None) -> ServerMessage:
        assert self.ws is not None
        return decode_server(self.ws.recv(timeout), self.load.wire_encoding)

    def _connect(self) -> bool:
        """Open or resume the session on a new socket; False after a failure (already reported)."""
        started = time.perf_counter()
        name = OPEN_NAME if self.session_id is None else RESUME_NAME
        try:
            subprotocol = Subprotocol(self.load.wire_encoding.subprotocol)
            # Entered as a context manager: websockets >= 17 deprecates using a bare `connect()`.
            # (Cast: websockets 16, which openai-agents needs, types `__enter__` as its base class.)
            self.ws = cast(
                ClientConnection,
                connect(
                    self.url,
                    subprotocols=[subprotocol],
                    additional_headers=handshake_headers(None, self.api_key),
                    open_timeout=_OPEN_TIMEOUT_S,
                    max_size=MAX_SERVER_FRAME_BYTES,
                    compression=None,
                    proxy=None,
                ).__enter__(),
            )
            if self.session_id is None:
                self._send(SessionOpen(OpenConfig(stop_token_ids=())))
            else:
                self._send(SessionResume(self.session_id, self.resume_token, self.last_output_seq))
            reply = self._recv(_OPEN_TIMEOUT_S)
        except (OSError, TimeoutError, WebSocketException) as exc:
            self._fail(name, type(exc).__name__, started)
            self._drop_socket()
            return False
        if isinstance(reply, SessionOpened):
            self.session_id, self.resume_token = reply.session_id, reply.resume_token
        elif isinstance(reply, SessionResumed):
            if reply.last_seq is not None:
                self.next_seq = max(self.next_seq, reply.last_seq + 1)
        else:
            code = reply.code.value if isinstance(reply, Error) else reply.type
            self._fail(name, code, started)
            if isinstance(reply, Error) and reply.retry_after_ms:
                self.paused_until = time.perf_counter() + reply.retry_after_ms / 1000.0
            if name == RESUME_NAME and code in _SESSION_GONE:  # the next attempt opens a new session
                self.session_id = None
            self._drop_socket()
            return False
        self.receiver = gevent.spawn(self._receive, self.ws)
        return True

    def _drop_socket(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.close()

    # ---- the receiver greenlet ----------------------------------------------------------------

    def _receive(self, ws: ClientConnection) -> None:
        encoding = self.load.wire_encoding
        try:
            for frame in ws:
                now = time.perf_counter()
                try:
                    message = decode_server(frame, encoding)
                except MicroturnError as exc:  # a frame this client cannot read: a failure, not a crash
                    self._fire(Outcome(SESSION_NAME, -1, 0.0, exc.code.value))
                    continue
                self._on_message(message, now, len(frame))
        except ConnectionClosed:
            pass
        finally:
            if self.ws is ws:
                self.ws = None  # the sender notices and resumes

    def _on_message(self, message: ServerMessage, now: float, length: int) -> None:
        if isinstance(message, OutputDone):
            self.last_output_seq = message.seq
            self.unanswered.pop(message.seq, None)
            outcome = self.inflight.done(message.seq, now, length)
            if outcome is not None:
                self._fire(outcome)
        elif isinstance(message, Error):
            if message.retry_after_ms:
                self.paused_until = max(self.paused_until, now + message.retry_after_ms / 1000.0)
            retry = message.seq is not None and message.retry_after_ms is not None
            if retry and message.seq is not None and self.inflight.can_retry(message.seq):
                self.resend.append(message.seq)  # sent again once the pause is over
                return
            if message.seq is not None:
                self.unanswered.pop(message.seq, None)
            failed = (
                None if message.seq is None else self.inflight.failed(message.seq, message.code.value, now)
            )
            if failed is not None:
                self._fire(failed)
            elif message.seq is None:
                self._fire(Outcome(SESSION_NAME, -1, 0.0, message.code.value))
        elif isinstance(message, SessionClosed) and not self.closing:
            # The server ended the session (idle timeout, eviction, a lost worker): start a new one.
            self._fire(Outcome(SESSION_NAME, -1, 0.0, message.reason))
            self.session_id = None

    # ---- the sender (the user's task) ---------------------------------------------------------

    @task
    def stream(self) -> None:
        interval = self.load.chunk_ms / 1000.0
        # Users started together should not send in lockstep.
        gevent.sleep(random.uniform(0.0, interval))
        next_at = time.perf_counter()
        while True:
            for outcome in self.inflight.expire(time.perf_counter(), _CHUNK_TIMEOUT_S):
                self.unanswered.pop(outcome.seq, None)
                self._fire(outcome)
            if self.ws is None and not self._connect():
                gevent.sleep(max(_RECONNECT_PAUSE_S, self.paused_until - time.perf_counter()))
                next_at = time.perf_counter()
                continue
            now = time.perf_counter()
            wake = max(next_at, self.paused_until)
            if wake > now:
                gevent.sleep(wake - now)
                continue
            if self.resend:
                self._resend_chunk(self.resend.popleft())
                continue
            self._send_chunk()
            # A fixed schedule; after a stall (a pause, a reconnect) restart it rather than burst.
            next_at = max(next_at + interval, time.perf_counter() - interval)

    def _send_chunk(self) -> None:
        load, index, seq = self.load, self.chunks_sent, self.next_seq
        reply = load.reply_for(index)
        if load.text is None:
            chunk = InputChunk(seq, tokens=load.tokens_for(index, self.salt), max_output_tokens=reply)
        else:
            chunk = InputChunk(seq, text=load.text_for(index), max_output_tokens=reply)
        self.inflight.sent(seq, load.name_for(index), time.perf_counter())
        self.next_seq, self.chunks_sent = seq + 1, index + 1
        self._transmit(chunk)

    def _resend_chunk(self, refused_seq: int) -> None:
        """A chunk refused with `retry_after_ms`, under the next seq (a later one may have landed)."""
        chunk = self.unanswered.pop(refused_seq, None)
        seq = self.next_seq
        if chunk is None or not self.inflight.retry(refused_seq, seq):
            return
        self.next_seq = seq + 1
        self._transmit(dataclasses.replace(chunk, seq=seq))

    def _transmit(self, chunk: InputChunk) -> None:
        self.unanswered[chunk.seq] = chunk
        try:
            self._send(chunk)
        except (ConnectionClosed, OSError):
            self.ws = None  # resumed on the next round; the chunk resolves by replay or timeout

    def on_stop(self) -> None:
        """Let the outputs in flight arrive, then close the session so the worker frees it."""
        deadline = time.perf_counter() + _DRAIN_S
        while len(self.inflight) and self.ws is not None and time.perf_counter() < deadline:
            gevent.sleep(0.02)
        if len(self.inflight):
            logger.warning("%d chunks unanswered at stop: not counted", len(self.inflight))
        self.closing = True
        if self.ws is not None:
            try:
                self._send(SessionClose())
                if self.receiver is not None:
                    self.receiver.join(timeout=2.0)  # ends once the server closes the socket
            except (ConnectionClosed, OSError):
                pass
        self._drop_socket()
        if self.receiver is not None:
            self.receiver.kill(block=False)
