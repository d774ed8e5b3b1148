"""The single writer of one client socket: an ordered queue of messages, then maybe a close.

Why a queue and one writer task: messages for a client come from two places, its own requests
(replies, errors, pongs) and its worker's frames (deltas, dones, unsolicited closes), the latter
delivered by the shared link reader, which must never wait for a client. Everything is put here
without awaiting, in the order it happened, and one task sends it; so the client sees messages in
exactly that order and a slow client only ever delays itself.

Memory stays bounded by the session limits: at most `max_queued_outputs` turns are in flight, each
with a bounded number of outputs. As a last line of defence, a client that lets `MAX_PENDING`
messages pile up (it stopped reading) is disconnected with `backpressure`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from starlette.websockets import WebSocket

from gateway.dialect import Dialect, Frame
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from shared.errors import ErrorCode
from shared.protocol.close_codes import close_code_for
from shared.protocol.messages import ClientMessage, Error, OutputDone, ServerMessage

logger = logging.getLogger(__name__)

MAX_PENDING: Final = 4096


@dataclass(slots=True)
class _Send:
    message: ServerMessage
    # When the turn's chunk arrived (monotonic s), for an `output.done`: the turn latency starts there.
    started: float | None


@dataclass(slots=True)
class _Raw:
    frame: Frame  # a dialect's own reply, already encoded


@dataclass(slots=True)
class _Close:
    code: int
    reason: str


class Outbox:
    def __init__(
        self,
        ws: WebSocket,
        dialect: Dialect,
        metrics: GatewayMetrics,
        on_turn: Callable[[float], None] | None = None,
        on_released: Callable[[tuple[ClientMessage, ...]], None] | None = None,
    ) -> None:
        self._ws = ws
        self._dialect = dialect
        self._metrics = metrics
        self._on_turn = on_turn
        self._on_released = on_released  # the shell runs the requests a dialect let go of
        self._queue: asyncio.Queue[_Send | _Raw | _Close] = asyncio.Queue()
        self._closing = False

    @property
    def closing(self) -> bool:
        """True once a close is queued: nothing put after it will be sent."""
        return self._closing

    def put(self, message: ServerMessage, started: float | None = None) -> None:
        self._put(_Send(message, started))

    def put_frame(self, frame: Frame) -> None:
        """A frame the dialect answered by itself, sent in its place in the order."""
        self._put(_Raw(frame))

    def _put(self, item: _Send | _Raw) -> None:
        if self._closing:
            logger.debug("socket closing; not sending %r", item)
            return
        if self._queue.qsize() >= MAX_PENDING:
            logger.warning("client stopped reading (%d messages pending); disconnecting it", MAX_PENDING)
            self._metrics.count(Metric.ERRORS, label=ErrorCode.BACKPRESSURE)
            self.close(close_code_for(ErrorCode.BACKPRESSURE), "client is not reading")
            return
        self._queue.put_nowait(item)

    def close(self, code: int, reason: str = "") -> None:
        """Close the socket once everything queued so far has been sent."""
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(_Close(code, reason))

    async def run(self) -> None:
        """Send until the queued close has gone out or the socket fails."""
        while True:
            item = await self._queue.get()
            if isinstance(item, _Close):
                try:
                    await self._ws.close(item.code, item.reason)
                except Exception as exc:  # the peer went away first: nothing left to tell it
                    logger.debug("close of a client socket failed: %r", exc)
                return
            if isinstance(item, _Raw):
                if not await self._send(item.frame):
                    return
                continue
            message = item.message
            try:
                frames = self._dialect.encode(message)
            except ValueError:
                # Only a non-finite float can do this (JSON has no NaN): a worker bug, reported typed.
                logger.exception("cannot encode %s", message.type)
                message = Error(ErrorCode.INTERNAL, f"could not encode a {message.type}", fatal=False)
                frames = self._dialect.encode(message)
            released = self._dialect.take_released()
            if released and self._on_released is not None:
                self._on_released(released)
            for frame in frames:
                if not await self._send(frame):
                    return
            if isinstance(message, OutputDone):
                self._metrics.count(Metric.OUTPUTS_DELIVERED)
                if item.started is not None:
                    elapsed = time.monotonic() - item.started
                    self._metrics.turn_latency.observe(elapsed)
                    if self._on_turn is not None:
                        self._on_turn(elapsed * 1000)
            elif isinstance(message, Error):
                self._metrics.count(Metric.ERRORS, label=message.code)

    async def _send(self, frame: Frame) -> bool:
        """Send one frame; False when the socket failed (the writer then stops)."""
        try:
            if isinstance(frame, str):
                await self._ws.send_text(frame)
            else:
                await self._ws.send_bytes(frame)
        except Exception as exc:
            logger.debug("send to a client failed: %r", exc)
            return False
        return True
