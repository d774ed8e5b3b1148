"""One gateway's link: reads frames into the service, writes the service's frames back in order.

Sending never blocks the service: frames go through a bounded queue to a writer task. A gateway
that stops reading until the queue is full is cut off (its sessions detach and stay resumable)
rather than letting one slow peer grow the worker's memory without bound.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.errors import InvalidMessage, MicroturnError
from shared.protocol.close_codes import CLOSE_TRY_AGAIN_LATER
from shared.protocol.link import (
    ToGateway,
    ToWorker,
    link_error_from,
)
from shared.protocol.link_codec import decode_link, encode_link
from worker.server.service import WorkerService

logger = logging.getLogger(__name__)

MAX_QUEUED_FRAMES = 65536


class LinkConnection:
    def __init__(self, websocket: WebSocket, service: WorkerService) -> None:
        self.websocket = websocket
        self.service = service
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue(MAX_QUEUED_FRAMES)
        self.closed = False

    def send(self, frame: ToGateway) -> None:
        if self.closed:
            return
        try:
            self.outbox.put_nowait(encode_link(frame))
        except asyncio.QueueFull:
            logger.warning("link outbox full: cutting the link off")
            self.closed = True
            self.outbox = asyncio.Queue(1)
            self.outbox.put_nowait(None)

    def pending_frames(self) -> int:
        """Frames queued and not yet written (a drain waits for its `migrate` frames to go out)."""
        return 0 if self.closed else self.outbox.qsize()

    async def serve(self) -> None:
        writer = asyncio.create_task(self._write())
        self.service.metrics.links += 1
        try:
            while not self.closed:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("bytes")
                if data is None:
                    self.send(link_error_from("", InvalidMessage("link frames are binary msgpack")))
                    continue
                try:
                    frame = decode_link(data)
                except MicroturnError as error:
                    self.send(link_error_from("", error))
                    continue
                if not isinstance(frame, ToWorker):
                    self.send(
                        link_error_from(frame.sid, InvalidMessage(f"{frame.op} is not sent to a worker"))
                    )
                    continue
                self.service.dispatch(self, frame)
        except WebSocketDisconnect:
            pass
        finally:
            self.closed = True
            self.service.metrics.links -= 1
            self.service.link_gone(self)
            writer.cancel()

    async def _write(self) -> None:
        while True:
            data = await self.outbox.get()
            if data is None:
                await self.websocket.close(code=CLOSE_TRY_AGAIN_LATER)
                return
            try:
                await self.websocket.send_bytes(data)
            except (WebSocketDisconnect, RuntimeError):
                self.closed = True
                return
