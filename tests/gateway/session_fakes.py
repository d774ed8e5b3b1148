"""Fakes for unit tests of one client session: a scripted worker behind a fake link, a session store
in memory, and a harness that feeds client frames and reads back what the socket would send.

No socket, no process, no sleep: a fake link answers a frame synchronously, from inside `send`,
through the real `LinkPool` routing (as the link reader would, only sooner), so every flow runs to
its end within the awaited call. A worker can be told to hold its answers, which leaves a flow
waiting at a known point (`opened` or `closed` not yet received).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.client_session import ClientSession
from gateway.dialect import NativeDialect
from gateway.limits import LimitValues
from gateway.links import Link, LinkPool
from gateway.metrics import GatewayMetrics
from gateway.session_store import Placed
from shared.errors import BadSequence, CapacityExhausted, SessionNotFound, Unauthorized, WorkerUnavailable
from shared.protocol.codec import Encoding, config_to_map, encode_client
from shared.protocol.link import (
    AuthLimits,
    LinkAttach,
    LinkChunk,
    LinkClose,
    LinkClosed,
    LinkDone,
    LinkOpen,
    LinkOpened,
    LinkRestore,
    ToGateway,
    ToWorker,
    link_error_from,
)
from shared.protocol.messages import (
    ClientMessage,
    InputChunk,
    OpenConfig,
    OutputDone,
    ServerMessage,
    SessionOpened,
    Timing,
)
from shared.settings import GatewaySettings
from shared.store.registry import SessionRecord
from shared.store.values import sha256_hex


@dataclass
class FakeWorker:
    """What a worker answers on its link, per session: opened, done (one output token per chunk, the
    session grows by the chunk's tokens plus it), closed; a seq not above the last accepted one is
    refused `bad_sequence`, as the engine does. `finished` is the worker's last finished seq."""

    worker_id: str
    answering: bool = True  # False: frames are recorded, nothing is answered
    durable: bool = False  # True: every done reports its own seq durable
    received: list[ToWorker] = field(default_factory=list)
    finished: dict[str, int | None] = field(default_factory=dict)
    length: dict[str, int] = field(default_factory=dict)

    def answer(self, frame: ToWorker) -> list[ToGateway]:
        self.received.append(frame)
        if not self.answering:
            return []
        sid = frame.sid
        if isinstance(frame, LinkOpen):
            self.finished[sid], self.length[sid] = None, 0
        if isinstance(frame, LinkRestore):
            return self._rebuild(frame)
        if isinstance(frame, LinkOpen | LinkAttach):
            if sid not in self.finished:
                return [link_error_from(sid, SessionNotFound("no such session"), fatal=True)]
            return [LinkOpened(sid, self.length[sid], self.finished[sid], self.finished[sid])]
        if isinstance(frame, LinkChunk):
            return self._run(sid, frame.chunk)
        if isinstance(frame, LinkClose):
            self.finished.pop(sid, None)
            return [LinkClosed(sid, "closed")]
        return []  # cancel, detach

    def _rebuild(self, frame: LinkRestore) -> list[ToGateway]:
        """As worker/server/restore.py, without a log: delivered tail turns become history, the
        rest re-run after `opened`; seq ordering resumes at the last turn the client saw."""
        sid = frame.sid
        delivered = [t for t in frame.tail if t.output is not None]
        seqs = [s for s in (frame.seen_seq, *(t.chunk.seq for t in delivered)) if s is not None]
        finished = max(seqs) if seqs else None
        reruns = [t.chunk for t in frame.tail if t.output is None]
        if reruns and finished is not None:
            finished = min(finished, reruns[0].seq - 1)
        self.finished[sid] = finished
        self.length[sid] = sum(len(t.chunk.tokens or ()) + len(t.output or ()) for t in delivered)
        opened = LinkOpened(sid, self.length[sid], finished, None)
        return [opened, *(reply for chunk in reruns for reply in self._run(sid, chunk))]

    def _run(self, sid: str, chunk: InputChunk) -> list[ToGateway]:
        last = self.finished.get(sid)
        if last is not None and chunk.seq <= last:
            return [link_error_from(sid, BadSequence(f"seq {chunk.seq} is not above {last}"), chunk.seq)]
        self.finished[sid] = chunk.seq
        self.length[sid] += len(chunk.tokens or ()) + 1
        durable = chunk.seq if self.durable else None
        done = OutputDone(chunk.seq, (7,), None, "length", Timing(0.0, 1.0))
        return [LinkDone(sid, done, self.length[sid], durable_seq=durable)]


class FakeLink(Link):
    """A link whose worker answers from inside `send`; `broken` makes every send fail."""

    def __init__(self, pool: LinkPool, url: str, worker: FakeWorker) -> None:
        super().__init__(pool, url, worker.worker_id)
        self.worker = worker
        self.broken = False

    async def send(self, frame: ToWorker) -> None:
        if self.broken:
            raise WorkerUnavailable(f"link to {self.url} broke while sending")
        for reply in self.worker.answer(frame):
            self._pool.dispatch(self, reply)


class FakePool(LinkPool):
    """The real routing (bind, unbind, dispatch, link loss) over fake links."""

    def __init__(self, workers: dict[str, FakeWorker]) -> None:
        super().__init__(GatewayMetrics())
        self.workers = workers

    def link(self, url: str, worker_id: str = "") -> Link:
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = FakeLink(self, url, self.workers[worker_id])
        return link


@dataclass
class FakeStore:
    """The session records in memory; placement takes the first worker not in `full` or suspected."""

    workers: list[str]
    suspects: Callable[[], list[str]]
    full: set[str] = field(default_factory=set)
    records: dict[str, tuple[SessionRecord, OpenConfig]] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)

    def _pick(self, avoid: str = "") -> str:
        for worker_id in self.workers:
            if worker_id not in self.full and worker_id not in self.suspects() and worker_id != avoid:
                return worker_id
        raise CapacityExhausted("no worker has room", retry_after_ms=1000)

    async def place_new(self, sid: str, token: str, config: OpenConfig, auth: AuthLimits | None) -> Placed:
        worker_id = self._pick()
        record = SessionRecord(
            worker_id, sha256_hex(token), "fake", 1, config=config_to_map(config), auth=auth
        )
        self.records[sid] = (record, config)
        return Placed(record, url_of(worker_id))

    async def move(self, sid: str, record: SessionRecord, config: OpenConfig) -> Placed:
        moved = dataclasses.replace(record, worker=self._pick(avoid=record.worker))
        self.records[sid] = (moved, config)
        return Placed(moved, url_of(moved.worker))

    async def lookup(self, sid: str, token: str) -> tuple[SessionRecord, OpenConfig]:
        if sid not in self.records:
            raise SessionNotFound(f"no session {sid}")
        record, config = self.records[sid]
        if record.token_sha256 != sha256_hex(token):
            raise Unauthorized("wrong resume token")
        return record, config

    async def worker_url(self, worker_id: str) -> str | None:
        return url_of(worker_id) if worker_id not in self.full else None

    async def delete(self, sid: str) -> None:
        self.records.pop(sid, None)
        self.deleted.append(sid)


def url_of(worker_id: str) -> str:
    return f"ws://{worker_id}:1"


@dataclass
class FakeServices:
    """What `ClientSession` uses of `GatewayServices`, with auth off."""

    pool: FakePool
    store: FakeStore
    settings: GatewaySettings = field(default_factory=lambda: GatewaySettings(open_timeout_s=1.0))
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    auth: Any = None

    @property
    def limits(self) -> LimitValues:
        return LimitValues.from_settings(self.settings)


class Gateway:
    """Two fake workers, their pool and store; `socket()` is one client socket on this gateway."""

    def __init__(self, worker_ids: tuple[str, ...] = ("w1", "w2")) -> None:
        self.workers = {w: FakeWorker(w) for w in worker_ids}
        self.pool = FakePool(self.workers)
        self.store = FakeStore(list(worker_ids), self.pool.suspects)
        self.services = FakeServices(self.pool, self.store)

    def socket(self) -> Socket:
        return Socket(self, ClientSession(None, NativeDialect(Encoding.JSON, 65536), self.services))  # type: ignore[arg-type]

    def link(self, worker_id: str) -> FakeLink:
        link = self.pool.link(url_of(worker_id), worker_id)
        assert isinstance(link, FakeLink)
        return link


@dataclass
class Socket:
    """One client socket: `send` feeds a client message as a frame, `replies` is what went out."""

    gateway: Gateway
    session: ClientSession
    closed_with: int | None = None  # the close code, once the socket queued its close
    resume_token: str = ""  # from the last `session.opened`

    async def send(self, message: ClientMessage) -> list[ServerMessage]:
        await self.session.handle_frame(encode_client(message, Encoding.JSON), 0.0)
        return self.replies()

    async def disconnect(self) -> None:
        """The client went away: what `ClientSession.run` does once its socket is gone."""
        await self.session._release()

    def replies(self) -> list[ServerMessage]:
        """Everything queued for the client since the last call (a close is `closed_with`)."""
        queue: asyncio.Queue[Any] = self.session.outbox._queue
        out: list[ServerMessage] = []
        while not queue.empty():
            item = queue.get_nowait()
            if hasattr(item, "message"):
                out.append(item.message)
                if isinstance(item.message, SessionOpened):
                    self.resume_token = item.message.resume_token
            else:
                self.closed_with = item.code
        return out

    @property
    def worker(self) -> FakeWorker:
        """The worker the session is on now."""
        sid = self.session.sid
        assert sid is not None
        return self.gateway.workers[self.gateway.store.records[sid][0].worker]
