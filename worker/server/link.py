"""The worker's end of the links: admits a gateway's link, reads its frames into the service and
writes the service's frames back in order (which link each session answers to: sessions.py).

Sending never blocks the service: frames go through a bounded queue to a writer task. A gateway
that stops reading until the queue is full is cut off (its sessions detach and stay resumable)
rather than letting one slow peer grow the worker's memory without bound.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.errors import InvalidMessage, MicroturnError
from shared.protocol.close_codes import CLOSE_POLICY_VIOLATION, CLOSE_TRY_AGAIN_LATER
from shared.protocol.link import LINK_SECRET_HEADER, ToGateway, ToWorker, link_error_from
from shared.protocol.link_codec import decode_link, encode_link
from worker.server.metrics import WorkerMetrics
from worker.server.sessions import LinkPeer

logger = logging.getLogger(__name__)

MAX_QUEUED_FRAMES = 65536


class FrameSink(Protocol):
    """What a link hands its frames to (the worker's `WorkerService`); the link never imports it."""

    @property
    def metrics(self) -> WorkerMetrics: ...

    def dispatch(self, link: LinkPeer, frame: ToWorker) -> None: ...

    def link_gone(self, link: LinkPeer) -> None: ...


class LinkConnection:
    def __init__(self, websocket: WebSocket, service: FrameSink) -> None:
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


class LinkHost(Protocol):
    """What admitting a link needs of the worker (worker/server/app.py's runtime)."""

    @property
    def link_secret(self) -> str: ...

    @property
    def service(self) -> FrameSink | None: ...

    @property
    def draining(self) -> asyncio.Event: ...


class LinkAcceptor:
    """The `/v1/link` route. Its coroutine is the one every frame of the link resumes, so it lives
    beside the connection it serves (docs/design.md section 10 counts the files a chunk runs)."""

    def __init__(self, host: LinkHost) -> None:
        self.host = host

    async def accept(self, websocket: WebSocket) -> None:
        service = self.host.service
        if await refused(
            websocket, self.host.link_secret, serving=service is not None, draining=self.host.draining
        ):
            return
        assert service is not None
        await websocket.accept()
        await LinkConnection(websocket, service).serve()


async def refused(
    websocket: WebSocket, secret: str | None, *, serving: bool, draining: asyncio.Event
) -> bool:
    """The rule every worker-to-worker and gateway-to-worker route admits a socket by (`/v1/link`,
    and the KV copies' `/v1/kv`): the link secret, when one is set, else a policy-violation close;
    a worker not serving yet or draining, a try-again-later close. True when it closed the socket."""
    offered = websocket.headers.get(LINK_SECRET_HEADER, "")
    if secret and not hmac.compare_digest(offered.encode(), secret.encode()):
        await websocket.close(code=CLOSE_POLICY_VIOLATION)
        return True
    if not serving or draining.is_set():
        await websocket.close(code=CLOSE_TRY_AGAIN_LATER)
        return True
    return False
