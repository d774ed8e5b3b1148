"""The worker's end of the links: admits a gateway's link, reads its frames into the service, writes
the service's frames back in order, and knows which link each session answers to.

Sending never blocks the service: frames go through a bounded queue to a writer task. A gateway
that stops reading until the queue is full is cut off (its sessions detach and stay resumable)
rather than letting one slow peer grow the worker's memory without bound.

Binding invariant: a session is bound to at most one link, the last one that opened, attached or
restored it. Its outputs go there and nowhere else; with no link bound (the client went away)
outputs are kept only in the replay buffer, for an `attach` to send again.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.errors import InvalidMessage, MicroturnError
from shared.protocol.close_codes import CLOSE_POLICY_VIOLATION, CLOSE_TRY_AGAIN_LATER
from shared.protocol.link import LINK_SECRET_HEADER, LinkDone, ToGateway, ToWorker, link_error_from
from shared.protocol.link_codec import decode_link, encode_link
from shared.protocol.messages import InputChunk, OpenConfig
from worker.server.restore import RestorePlan

if TYPE_CHECKING:  # the service imports the bindings below; the link only calls into it
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


REPLAY_DONES = 32


class LinkPeer(Protocol):
    """The sending half of one gateway's link; `send` never blocks."""

    def send(self, frame: ToGateway) -> None: ...


@dataclass(eq=False)
class SessionBinding:
    sid: str
    stream: bool
    idle_timeout_s: float
    link: LinkPeer | None
    length: int = 0
    # The last seq the session finished here (None: none yet), as `opened` reports it.
    finished_seq: int | None = None
    # False while the session is being opened or rebuilt; chunks that arrive meanwhile wait here.
    ready: bool = False
    waiting: list[InputChunk] = field(default_factory=list)
    replay: deque[LinkDone] = field(default_factory=lambda: deque(maxlen=REPLAY_DONES))
    # What the session record holds, so this worker can re-write it after Redis lost its data.
    config: OpenConfig = field(default_factory=OpenConfig)
    token_sha256: str | None = None
    created_ms: int = 0
    # Set while a restore opens the session: what `opened` still has to log, answer and run.
    restore: RestorePlan | None = None

    def send(self, frame: ToGateway) -> None:
        if self.link is not None:
            self.link.send(frame)

    def record(self, done: LinkDone) -> None:
        self.replay.append(done)
        self.length = done.length
        self.finished_seq = done.done.seq

    def missed(self, seen_seq: int | None) -> list[LinkDone]:
        """The dones after the last one the client saw, as far as the replay buffer reaches."""
        return [d for d in self.replay if seen_seq is None or d.done.seq > seen_seq]


class SessionDirectory:
    def __init__(self) -> None:
        self.bindings: dict[str, SessionBinding] = {}
        # Sessions with traffic since the last heartbeat: their Redis TTLs get refreshed then.
        self.touched: set[str] = set()

    def get(self, sid: str) -> SessionBinding | None:
        return self.bindings.get(sid)

    def add(self, binding: SessionBinding) -> None:
        self.bindings[binding.sid] = binding
        self.touched.add(binding.sid)

    def remove(self, sid: str) -> SessionBinding | None:
        self.touched.discard(sid)
        return self.bindings.pop(sid, None)

    def unbind_link(self, link: LinkPeer) -> int:
        count = 0
        for binding in self.bindings.values():
            if binding.link is link:
                binding.link = None
                count += 1
        return count

    def take_touched(self) -> dict[str, float]:
        """The touched sessions and their idle timeouts, clearing the set."""
        touched = {sid: self.bindings[sid].idle_timeout_s for sid in self.touched if sid in self.bindings}
        self.touched.clear()
        return touched


class LinkHost(Protocol):
    """What admitting a link needs of the worker (worker/server/app.py's runtime)."""

    @property
    def link_secret(self) -> str: ...

    @property
    def service(self) -> WorkerService | None: ...

    @property
    def draining(self) -> asyncio.Event: ...


class LinkAcceptor:
    """The `/v1/link` route. Its coroutine is the one every frame of the link resumes, so it lives
    beside the connection it serves (docs/design.md section 10 counts the files a chunk runs)."""

    def __init__(self, host: LinkHost) -> None:
        self.host = host

    async def accept(self, websocket: WebSocket) -> None:
        secret = self.host.link_secret
        offered = websocket.headers.get(LINK_SECRET_HEADER, "")
        if secret and not hmac.compare_digest(offered.encode(), secret.encode()):
            await websocket.close(code=CLOSE_POLICY_VIOLATION)
            return
        service = self.host.service
        if service is None or self.host.draining.is_set():
            await websocket.close(code=CLOSE_TRY_AGAIN_LATER)
            return
        await websocket.accept()
        await LinkConnection(websocket, service).serve()
