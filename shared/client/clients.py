"""The Python client of protocol v1: `RealtimeClient` (asyncio) and `SyncRealtimeClient` (blocking).

Two shells around one Sans-I/O core (shared/client/core.py): tests and tools run on asyncio, Locust
on gevent, where only `websockets.sync` runs. The core decides everything that is not I/O (which
message answers a request, what is buffered for `recv()` in order, which error raises, which refused
chunk is resent after its `retry_after_ms`: shared/client/retry.py), so both behave identically. An
error answering the request, any fatal error and an unsolicited `session.closed` raise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Final, Generic, TypedDict, TypeVar, Unpack

from websockets.asyncio.client import ClientConnection as AsyncConnection
from websockets.asyncio.client import connect as async_connect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection as SyncConnection
from websockets.sync.client import connect as sync_connect

from shared.client.core import (
    MAX_SERVER_FRAME_BYTES,
    ClientCore,
    ConnectionLost,
    EncodingName,
    Feed,
    ReplyWaiter,
    Request,
    SessionClosedError,
    TurnWaiter,
    chunk_message,
    encoding_of,
    handshake_headers,
    lost,
    open_config,
)
from shared.client.retry import NO_RETRY, RetryPolicy
from shared.protocol.codec import Encoding
from shared.protocol.messages import (
    ClientMessage,
    OutputCancel,
    OutputDelta,
    OutputDone,
    Pong,
    ServerMessage,
    SessionClosed,
    SessionOpened,
    SessionResumed,
    SessionRewind,
    SessionRewound,
)
from shared.protocol.response_format import ResponseFormat

logger = logging.getLogger(__name__)
R = TypeVar("R")
C = TypeVar("C", AsyncConnection, SyncConnection)

DEFAULT_TIMEOUT_S: Final = 30.0

__all__ = [
    "NO_RETRY",
    "ClientCore",
    "ConnectOptions",
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


# ---- what both shells share --------------------------------------------------------------------


class ConnectOptions(TypedDict, total=False):
    """What `connect` takes besides the URL and the encoding (both shells take the same)."""

    open_timeout: float  # seconds for the handshake (default 10)
    headers: Mapping[str, str] | None  # extra handshake headers
    api_key: str | None  # sent as `Authorization: Bearer`
    # How refused chunks are resent (None: `RetryPolicy()`; `NO_RETRY` turns it off).
    retry: RetryPolicy | None


def _connect_options(enc: Encoding, options: ConnectOptions) -> dict[str, Any]:
    """The handshake both shells make (websockets' asyncio and sync `connect` take the same)."""
    return {
        "subprotocols": [enc.subprotocol],
        "open_timeout": options.get("open_timeout", 10.0),
        "additional_headers": handshake_headers(options.get("headers"), options.get("api_key")),
        "max_size": MAX_SERVER_FRAME_BYTES,
        "compression": None,
        "proxy": None,
    }


class _ClientShell(Generic[C]):
    """A socket and the core that decides everything else; the views of the core's state."""

    def __init__(self, ws: C, encoding: Encoding, retry: RetryPolicy | None = None) -> None:
        self.ws: C = ws
        self._core = ClientCore(encoding, retry)

    @property
    def encoding(self) -> Encoding:
        return self._core.encoding

    @property
    def session_id(self) -> str | None:
        return self._core.session_id

    @property
    def resume_token(self) -> str | None:
        return self._core.resume_token

    @property
    def last_deltas(self) -> list[OutputDelta]:
        """The deltas of the last `turn()` (empty unless the session streams)."""
        return self._core.last_deltas

    @property
    def buffered(self) -> tuple[ServerMessage, ...]:
        """Messages received while a request waited for its answer, not yet handed out by recv()."""
        return tuple(self._core.buffer)

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code


# ---- asyncio ------------------------------------------------------------------------------------


class RealtimeClient(_ClientShell[AsyncConnection]):
    """One client socket (one session) on asyncio. Use `await RealtimeClient.connect(url)`."""

    @classmethod
    async def connect(
        cls, url: str, encoding: EncodingName | Encoding = "json", **options: Unpack[ConnectOptions]
    ) -> RealtimeClient:
        """`options`: see `ConnectOptions`."""
        enc = encoding_of(encoding)
        return cls(await async_connect(url, **_connect_options(enc, options)), enc, options.get("retry"))

    async def __aenter__(self) -> RealtimeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.disconnect()

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

    async def _run(self, request: Request[R], timeout: float | None) -> R:
        if request.message is not None:
            await self.send(request.message)
        if not self._core.scan(request.waiter):
            async with asyncio.timeout(timeout):
                while not self._core.offer(request.waiter, await self._read(None)):
                    pass
        return request.finish()

    async def open(self, *, timeout: float | None = DEFAULT_TIMEOUT_S, **config: Any) -> SessionOpened:
        return await self._run(self._core.open(open_config(**config)), timeout)

    async def resume(
        self,
        session_id: str,
        resume_token: str,
        last_seq: int | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SessionResumed:
        return await self._run(self._core.resume(session_id, resume_token, last_seq), timeout)

    async def send_chunk(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
        response_format: ResponseFormat | None = None,
    ) -> None:
        await self.send(
            self._core.chunk(
                chunk_message(
                    seq,
                    tokens,
                    text,
                    max_output_tokens,
                    logprobs,
                    flush=flush,
                    response_format=response_format,
                )
            )
        )

    async def cancel(self, seq: int) -> None:
        await self.send(self._core.cancel(seq))

    async def cancel_keeping(
        self, seq: int, keep_output_tokens: int, *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> SessionRewound:
        """Stop turn `seq` (or take back the session's last, finished turn) keeping only its first
        `keep_output_tokens` outputs in the history."""
        return await self._run(self._core.rewind(OutputCancel(seq, keep_output_tokens)), timeout)

    async def rewind(
        self,
        *,
        to_seq: int | None = None,
        keep_tokens: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SessionRewound:
        """Take the session's history back to turn `to_seq`'s end or to its first `keep_tokens`."""
        return await self._run(self._core.rewind(SessionRewind(to_seq, keep_tokens)), timeout)

    async def ping(self, data: object = None, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Pong:
        return await self._run(self._core.ping(data), timeout)

    async def turn(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
        response_format: ResponseFormat | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> OutputDone:
        """Send one chunk and wait for its `output.done` (its deltas end up in `last_deltas`)."""
        await self.send_chunk(
            seq, tokens, text, max_output_tokens, logprobs, flush=flush, response_format=response_format
        )
        return await self.wait_done(seq, timeout=timeout)

    async def wait_done(self, seq: int, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> OutputDone:
        """Wait for turn `seq`'s `output.done`, resending its chunk after retryable refusals."""
        while not isinstance(answer := await self._run(self._core.wait_turn(seq), timeout), OutputDone):
            await asyncio.sleep(answer)
            await self.send(self._core.resend(seq))
        return answer

    async def close(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> SessionClosed:
        """End the session (`session.close`), wait for `session.closed`, then close the socket."""
        try:
            return await self._run(self._core.close(), timeout)
        finally:
            await self.disconnect()

    async def disconnect(self) -> None:
        """Close the socket without ending the session: it stays resumable until its idle timeout."""
        await self.ws.close()


# ---- blocking (gevent-friendly) -----------------------------------------------------------------


class SyncRealtimeClient(_ClientShell[SyncConnection]):
    """The same client on `websockets.sync` (threads or gevent, no asyncio)."""

    @classmethod
    def connect(
        cls, url: str, encoding: EncodingName | Encoding = "json", **options: Unpack[ConnectOptions]
    ) -> SyncRealtimeClient:
        enc = encoding_of(encoding)
        return cls(sync_connect(url, **_connect_options(enc, options)), enc, options.get("retry"))

    def __enter__(self) -> SyncRealtimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disconnect()

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

    def _run(self, request: Request[R], timeout: float | None) -> R:
        if request.message is not None:
            self.send(request.message)
        if not self._core.scan(request.waiter):
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no answer within {timeout} s")
                if self._core.offer(request.waiter, self._read(left)):
                    break
        return request.finish()

    def open(self, *, timeout: float | None = DEFAULT_TIMEOUT_S, **config: Any) -> SessionOpened:
        return self._run(self._core.open(open_config(**config)), timeout)

    def resume(
        self,
        session_id: str,
        resume_token: str,
        last_seq: int | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SessionResumed:
        return self._run(self._core.resume(session_id, resume_token, last_seq), timeout)

    def send_chunk(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
        response_format: ResponseFormat | None = None,
    ) -> None:
        self.send(
            self._core.chunk(
                chunk_message(
                    seq,
                    tokens,
                    text,
                    max_output_tokens,
                    logprobs,
                    flush=flush,
                    response_format=response_format,
                )
            )
        )

    def cancel(self, seq: int) -> None:
        self.send(self._core.cancel(seq))

    def cancel_keeping(
        self, seq: int, keep_output_tokens: int, *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> SessionRewound:
        """See `RealtimeClient.cancel_keeping`."""
        return self._run(self._core.rewind(OutputCancel(seq, keep_output_tokens)), timeout)

    def rewind(
        self,
        *,
        to_seq: int | None = None,
        keep_tokens: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> SessionRewound:
        """See `RealtimeClient.rewind`."""
        return self._run(self._core.rewind(SessionRewind(to_seq, keep_tokens)), timeout)

    def ping(self, data: object = None, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Pong:
        return self._run(self._core.ping(data), timeout)

    def turn(
        self,
        seq: int,
        tokens: list[int] | tuple[int, ...] | None = None,
        text: str | None = None,
        max_output_tokens: int | None = None,
        logprobs: bool | None = None,
        *,
        flush: bool | None = None,
        response_format: ResponseFormat | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
    ) -> OutputDone:
        self.send_chunk(
            seq, tokens, text, max_output_tokens, logprobs, flush=flush, response_format=response_format
        )
        return self.wait_done(seq, timeout=timeout)

    def wait_done(self, seq: int, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> OutputDone:
        """Wait for turn `seq`'s `output.done`, resending its chunk after retryable refusals."""
        while not isinstance(answer := self._run(self._core.wait_turn(seq), timeout), OutputDone):
            time.sleep(answer)
            self.send(self._core.resend(seq))
        return answer

    def close(self, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> SessionClosed:
        try:
            return self._run(self._core.close(), timeout)
        finally:
            self.disconnect()

    def disconnect(self) -> None:
        self.ws.close()
