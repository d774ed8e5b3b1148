"""The Python client of protocol v1: `RealtimeClient` (asyncio) and `SyncRealtimeClient` (blocking).

Why two shells around one core: tests, benchmarks and demo tooling run on asyncio, but Locust runs
on gevent, where asyncio websockets cannot run; `websockets.sync` can. Everything that is not I/O
(encoding, decoding, matching replies, buffering, retries) lives in `ClientCore` and the waiters
(shared/client_core.py), so the two clients behave identically.

Message matching: a request (`open`, `resume`, `ping`, `turn`, `close`) waits for its own answer.
Whatever else arrives meanwhile (outputs of other turns, `session.restored`, recoverable errors for
other chunks) is buffered in order and handed out by later `recv()` calls: nothing is dropped.
An `error` that answers the request (no `seq`, or the turn's `seq`), any fatal `error`, and an
unsolicited `session.closed` raise: the typed `MicroturnError` for the code, or `SessionClosedError`.
A refused chunk whose error carries `retry_after_ms` is first sent again, as `retry` says
(shared/client_retry.py); only when the retries run out does its error raise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Final

from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection as SyncConnection
from websockets.sync.client import connect as sync_connect

from shared.client_core import (
    ClientCore,
    ConnectionLost,
    EncodingName,
    Feed,
    ReplyWaiter,
    SessionClosedError,
    TurnWaiter,
    Waiter,
    chunk_message,
    encoding_of,
    handshake_headers,
    lost,
    open_config,
)
from shared.client_retry import NO_RETRY, RetryPolicy
from shared.protocol import (
    ClientMessage,
    Encoding,
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
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 30.0
# Server frames are small; this only bounds a misbehaving server.
MAX_FRAME_BYTES: Final = 16 * 2**20

__all__ = [
    "NO_RETRY",
    "ClientCore",
    "ConnectionLost",
    "EncodingName",
    "Feed",
    "RealtimeClient",
    "ReplyWaiter",
    "RetryPolicy",
    "SessionClosedError",
    "SyncRealtimeClient",
    "TurnWaiter",
    "open_config",
]


# ---- asyncio ------------------------------------------------------------------------------------


class RealtimeClient:
    """One client socket (one session) on asyncio. Use `await RealtimeClient.connect(url)`."""

    def __init__(self, ws: AsyncConnection, encoding: Encoding, retry: RetryPolicy | None = None) -> None:
        self.ws = ws
        self._core = ClientCore(encoding, retry)
        self.session_id: str | None = None
        self.resume_token: str | None = None
        # The deltas of the last `turn()` (empty unless the session streams).
        self.last_deltas: list[OutputDelta] = []

    @classmethod
    async def connect(
        cls,
        url: str,
        encoding: EncodingName | Encoding = "json",
        *,
        open_timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> RealtimeClient:
        """`retry`: how refused chunks are resent (default `RetryPolicy()`; `NO_RETRY` turns it off)."""
        enc = encoding_of(encoding)
        ws = await async_connect(
            url,
            subprotocols=[enc.subprotocol],  # type: ignore[list-item]  # Subprotocol is a NewType of str
            open_timeout=open_timeout,
            additional_headers=handshake_headers(headers, api_key),
            max_size=MAX_FRAME_BYTES,
            compression=None,
            proxy=None,
        )
        return cls(ws, enc, retry)

    async def __aenter__(self) -> RealtimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

    @property
    def encoding(self) -> Encoding:
        return self._core.encoding

    @property
    def buffered(self) -> tuple[ServerMessage, ...]:
        """Messages received while a request waited for its answer, not yet handed out by recv()."""
        return tuple(self._core.buffer)

    async def send(self, msg: ClientMessage) -> None:
        try:
            await self.ws.send(self._core.encode(msg))
        except ConnectionClosed as exc:
            raise lost(exc) from exc

    async def send_raw(self, frame: str | bytes) -> None:
        """Send a frame as is (tests use it for malformed input)."""
        await self.ws.send(frame)

    async def _read(self, timeout: float | None) -> ServerMessage:
        try:
            frame = await asyncio.wait_for(self.ws.recv(), timeout)
        except ConnectionClosed as exc:
            raise lost(exc) from exc
        return self._core.decode(frame)

    async def recv(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> ServerMessage:
        """The next message not claimed by a request; raises TimeoutError after `timeout` s."""
        if self._core.buffer:
            return self._core.buffer.popleft()
        return await self._read(timeout)

    async def _wait(self, waiter: Waiter, timeout: float | None) -> None:
        if self._core.scan(waiter):
            return
        async with asyncio.timeout(timeout):
            while not self._core.offer(waiter, await self._read(None)):
                pass

    async def open(self, *, timeout: float | None = DEFAULT_TIMEOUT_S, **config: Any) -> SessionOpened:
        await self.send(SessionOpen(open_config(**config)))
        waiter = ReplyWaiter(SessionOpened)
        await self._wait(waiter, timeout)
        assert isinstance(waiter.result, SessionOpened)
        self.session_id, self.resume_token = waiter.result.session_id, waiter.result.resume_token
        return waiter.result

    async def resume(
        self,
        session_id: str,
        resume_token: str,
        last_seq: int | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SessionResumed:
        await self.send(SessionResume(session_id, resume_token, last_seq))
        waiter = ReplyWaiter(SessionResumed)
        await self._wait(waiter, timeout)
        assert isinstance(waiter.result, SessionResumed)
        self.session_id, self.resume_token = session_id, resume_token
        return waiter.result

    async def send_chunk(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
    ) -> None:
        chunk = chunk_message(seq, tokens, text, max_output_tokens, logprobs, flush=flush)
        self._core.retries.sent(chunk)
        await self.send(chunk)

    async def cancel(self, seq: int) -> None:
        await self.send(OutputCancel(seq))

    async def ping(self, data: object = None, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Pong:
        await self.send(Ping(data))
        waiter = ReplyWaiter(Pong)
        await self._wait(waiter, timeout)
        assert isinstance(waiter.result, Pong)
        return waiter.result

    async def turn(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> OutputDone:
        """Send one chunk and wait for its `output.done` (its deltas end up in `last_deltas`)."""
        await self.send_chunk(seq, tokens, text, max_output_tokens, logprobs, flush=flush)
        return await self.wait_done(seq, timeout=timeout)

    async def wait_done(self, seq: int, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> OutputDone:
        """Wait for turn `seq`'s `output.done`, resending its chunk after retryable refusals."""
        while True:
            waiter = TurnWaiter(seq, self._core.retries)
            await self._wait(waiter, timeout)
            if waiter.retry_in is None:
                break
            await asyncio.sleep(waiter.retry_in)
            await self.send(self._core.retries.resend(seq))
        assert waiter.result is not None
        self.last_deltas = waiter.deltas
        return waiter.result

    async def close(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> SessionClosed:
        """End the session (`session.close`), wait for `session.closed`, then close the socket."""
        await self.send(SessionClose())
        waiter = ReplyWaiter(SessionClosed)
        try:
            await self._wait(waiter, timeout)
        finally:
            await self.disconnect()
        assert isinstance(waiter.result, SessionClosed)
        return waiter.result

    async def disconnect(self) -> None:
        """Close the socket without ending the session: it stays resumable until its idle timeout."""
        await self.ws.close()

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code


# ---- blocking (gevent-friendly) -----------------------------------------------------------------


class SyncRealtimeClient:
    """The same client on `websockets.sync` (threads or gevent, no asyncio)."""

    def __init__(self, ws: SyncConnection, encoding: Encoding, retry: RetryPolicy | None = None) -> None:
        self.ws = ws
        self._core = ClientCore(encoding, retry)
        self.session_id: str | None = None
        self.resume_token: str | None = None
        self.last_deltas: list[OutputDelta] = []

    @classmethod
    def connect(
        cls,
        url: str,
        encoding: EncodingName | Encoding = "json",
        *,
        open_timeout: float = 10.0,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> SyncRealtimeClient:
        enc = encoding_of(encoding)
        ws = sync_connect(
            url,
            subprotocols=[enc.subprotocol],  # type: ignore[list-item]  # Subprotocol is a NewType of str
            open_timeout=open_timeout,
            additional_headers=handshake_headers(headers, api_key),
            max_size=MAX_FRAME_BYTES,
            compression=None,
            proxy=None,
        )
        return cls(ws, enc, retry)

    def __enter__(self) -> SyncRealtimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

    @property
    def encoding(self) -> Encoding:
        return self._core.encoding

    @property
    def buffered(self) -> tuple[ServerMessage, ...]:
        """Messages received while a request waited for its answer, not yet handed out by recv()."""
        return tuple(self._core.buffer)

    def send(self, msg: ClientMessage) -> None:
        try:
            self.ws.send(self._core.encode(msg))
        except ConnectionClosed as exc:
            raise lost(exc) from exc

    def send_raw(self, frame: str | bytes) -> None:
        self.ws.send(frame)

    def _read(self, timeout: float | None) -> ServerMessage:
        try:
            frame = self.ws.recv(timeout)
        except ConnectionClosed as exc:
            raise lost(exc) from exc
        return self._core.decode(frame)

    def recv(self, timeout: float | None = DEFAULT_TIMEOUT_S) -> ServerMessage:
        if self._core.buffer:
            return self._core.buffer.popleft()
        return self._read(timeout)

    def _wait(self, waiter: Waiter, timeout: float | None) -> None:
        if self._core.scan(waiter):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no answer within {timeout} s")
            if self._core.offer(waiter, self._read(left)):
                return

    def open(self, *, timeout: float | None = DEFAULT_TIMEOUT_S, **config: Any) -> SessionOpened:
        self.send(SessionOpen(open_config(**config)))
        waiter = ReplyWaiter(SessionOpened)
        self._wait(waiter, timeout)
        assert isinstance(waiter.result, SessionOpened)
        self.session_id, self.resume_token = waiter.result.session_id, waiter.result.resume_token
        return waiter.result

    def resume(
        self,
        session_id: str,
        resume_token: str,
        last_seq: int | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SessionResumed:
        self.send(SessionResume(session_id, resume_token, last_seq))
        waiter = ReplyWaiter(SessionResumed)
        self._wait(waiter, timeout)
        assert isinstance(waiter.result, SessionResumed)
        self.session_id, self.resume_token = session_id, resume_token
        return waiter.result

    def send_chunk(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
    ) -> None:
        chunk = chunk_message(seq, tokens, text, max_output_tokens, logprobs, flush=flush)
        self._core.retries.sent(chunk)
        self.send(chunk)

    def cancel(self, seq: int) -> None:
        self.send(OutputCancel(seq))

    def ping(self, data: object = None, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Pong:
        self.send(Ping(data))
        waiter = ReplyWaiter(Pong)
        self._wait(waiter, timeout)
        assert isinstance(waiter.result, Pong)
        return waiter.result

    def turn(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> OutputDone:
        self.send_chunk(seq, tokens, text, max_output_tokens, logprobs, flush=flush)
        return self.wait_done(seq, timeout=timeout)

    def wait_done(self, seq: int, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> OutputDone:
        """Wait for turn `seq`'s `output.done`, resending its chunk after retryable refusals."""
        while True:
            waiter = TurnWaiter(seq, self._core.retries)
            self._wait(waiter, timeout)
            if waiter.retry_in is None:
                break
            time.sleep(waiter.retry_in)
            self.send(self._core.retries.resend(seq))
        assert waiter.result is not None
        self.last_deltas = waiter.deltas
        return waiter.result

    def close(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> SessionClosed:
        self.send(SessionClose())
        waiter = ReplyWaiter(SessionClosed)
        try:
            self._wait(waiter, timeout)
        finally:
            self.disconnect()
        assert isinstance(waiter.result, SessionClosed)
        return waiter.result

    def disconnect(self) -> None:
        self.ws.close()

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code
