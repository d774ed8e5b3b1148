"""The receiving end of a drain's KV copy: another worker's session pages, kept as a warm copy.

The draining worker dials `/v1/kv` (shared/protocol/kv_copy.py has the stream) before it asks for
the copy with `warm` on the link. Per session this worker checks the header (the pages' format
must be its own: the same model fingerprint, dtype, page size and layout; it must not be draining
nor hold the session), reads the pages (whole pages, bounded by the header's count), checks the
CRC-32, reads the session's token log and opens a COPY (worker/server/lifecycle.py) holding the
KV of the longest prefix of the log's history that the pages cover (`Engine.import_copy`: into
the host tier, or the device when the tier has no room; on the CPU the device first). `warm` then
finds the copy and only catches up on the turns logged after the copy's point (worker/server/warm.py).

Every refusal names its reason (the sender counts it and asks for the rebuild from the log): a
format mismatch, a bad checksum, a broken stream, no room, or anything else (`refused`). A copy
no `warm` claimed is discarded `WARM_GRACE_S` after its stream closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import replace
from typing import Protocol

import redis.asyncio as redis
import torch
from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.errors import CapacityExhausted, InvalidMessage, MicroturnError
from shared.protocol.close_codes import CLOSE_POLICY_VIOLATION
from shared.protocol.kv_copy import (
    FallbackReason,
    KVHeader,
    KVReady,
    KVRefused,
    KVStored,
    decode_kv,
    encode_kv,
)
from shared.settings import WorkerSettings
from shared.store.schema import KeySchema
from worker.dtypes import torch_dtype
from worker.engine import Engine
from worker.server.link import refused
from worker.server.metrics import WorkerMetrics
from worker.server.restore import plan_restore
from worker.server.sessions import WorkerSession, WorkerSessions
from worker.server.token_log import read_log_bytes
from worker.server.warm import WARM_GRACE_S, WarmCopies

logger = logging.getLogger(__name__)


class KVCopyHost(Protocol):
    """What receiving copies needs of the worker's service (worker/server/service.py)."""

    engine: Engine
    redis: redis.Redis
    schema: KeySchema
    settings: WorkerSettings
    loop: asyncio.AbstractEventLoop
    sessions: WorkerSessions
    metrics: WorkerMetrics
    warm: WarmCopies
    draining: bool


class _Refused(Exception):
    def __init__(self, reason: FallbackReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class KVReceiver:
    """One draining worker's stream: its sessions' pages, one after the other."""

    def __init__(self, websocket: WebSocket, service: KVCopyHost) -> None:
        self.websocket = websocket
        self.service = service
        self.imported: list[WorkerSession] = []
        # The pages of the session being received, reused by the next one on this stream: a fresh
        # buffer per session (18 MB for a 4k-token `tiny` session) cost a page fault per 4 KB on the
        # event loop, which serves this worker's own sessions meanwhile. Replaced, never resized: an
        # import may still hold a view of it.
        self.buffer = bytearray()

    async def serve(self) -> None:
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                try:
                    header = decode_kv(message.get("bytes") or message.get("text") or b"")
                except InvalidMessage as exc:
                    logger.warning("KV copy stream: %s", exc.message)
                    await self.websocket.close(code=CLOSE_POLICY_VIOLATION)
                    break
                if not isinstance(header, KVHeader):
                    logger.warning("KV copy stream: expected a header, got %s", header.op)
                    await self.websocket.close(code=CLOSE_POLICY_VIOLATION)
                    break
                if not await self._one(header):
                    break
        except WebSocketDisconnect:
            pass
        finally:
            for copy in self.imported:  # a copy no `warm` claimed: its sender went away
                if copy.asked_by is None:
                    self.service.loop.call_later(WARM_GRACE_S, self._unclaimed, copy)

    async def _one(self, header: KVHeader) -> bool:
        """Receive one session's copy; False when the stream is no longer usable."""
        service, sid = self.service, header.sid
        started = time.monotonic()
        try:
            mismatch = service.engine.kv_format.mismatch(header.format)
            if mismatch is not None:
                raise _Refused(mismatch, f"theirs {header.format}, ours {service.engine.kv_format}")
            if service.draining or service.sessions.entry(sid) is not None:
                raise _Refused("refused", "draining" if service.draining else "the session is already here")
            await self.websocket.send_bytes(encode_kv(KVReady(sid)))
            payload = await self._payload(header)
            received = time.monotonic()
            copy = service.sessions.add_copy(sid, None, kv_imported=True)
            try:
                kept = await self._import(header, payload)
            except BaseException:
                service.sessions.drop_copy(sid, copy)
                raise
        except _Refused as refused:
            service.metrics.kv_copy_refused(refused.reason)
            logger.warning("KV copy of session %s refused (%s): %s", sid, refused.reason, refused.detail)
            await self.websocket.send_bytes(encode_kv(KVRefused(sid, refused.reason, refused.detail[:200])))
            return refused.reason != "stream"
        copy.length = kept
        self.imported.append(copy)
        service.metrics.kv_copies_received += 1
        logger.info(
            "KV copy of session %s stored: %d of its tokens (%d pages, %.1f MB) in %.1f ms (%.1f ms "
            "the pages took to arrive)",
            sid,
            kept,
            header.pages,
            len(payload) / 1e6,
            (time.monotonic() - started) * 1000,
            (received - started) * 1000,
        )
        await self.websocket.send_bytes(encode_kv(KVStored(sid, kept)))
        return True

    async def _payload(self, header: KVHeader) -> memoryview:
        """The header's pages, whole pages per frame, their CRC-32 checked (in a thread: zlib lets
        go of the GIL, and the event loop serves this worker's sessions meanwhile)."""
        page_bytes = self.service.engine.kv_format.page_bytes
        size = header.pages * page_bytes
        if len(self.buffer) < size:
            self.buffer = bytearray(size)
        payload = memoryview(self.buffer)[:size]
        received = 0
        while received < size:
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(1006)
            frame = message.get("bytes")
            if frame is None or len(frame) % page_bytes or received + len(frame) > size:
                raise _Refused("stream", f"a payload frame of {len(frame or b'')} bytes is no run of pages")
            payload[received : received + len(frame)] = frame
            received += len(frame)
        crc = await asyncio.to_thread(zlib.crc32, payload)
        if crc != header.checksum:
            raise _Refused("checksum", f"CRC-32 {crc:#010x}, the header says {header.checksum:#010x}")
        return payload

    async def _import(self, header: KVHeader, payload: memoryview) -> int:
        """Open the copy from the log's history with the pages' KV of its common prefix."""
        service, sid = self.service, header.sid
        try:
            rules = service.engine.session_rules(header.config)
            log = await read_log_bytes(service.redis, service.schema, sid)
            plan = plan_restore(sid, log, (), None, rules=rules)
        except (redis.RedisError, ValueError, MicroturnError) as exc:
            raise _Refused("refused", f"the session's log: {exc}") from exc
        idle = rules.config.idle_timeout_s or service.settings.idle_timeout_s
        data = torch.frombuffer(payload, dtype=torch_dtype(header.format.dtype))
        future = service.engine.import_copy(
            sid,
            config=replace(rules.config, idle_timeout_s=idle),
            history=plan.history,
            accepted_seq=plan.finished_seq,
            text_tail=plan.text_tail,
            kv_tokens=header.tokens,
            kv=data,
        )
        try:
            return await asyncio.wrap_future(future)
        except CapacityExhausted as exc:
            raise _Refused("room", exc.message) from exc
        except (MicroturnError, ValueError) as exc:
            raise _Refused("refused", str(exc)) from exc

    def _unclaimed(self, copy: WorkerSession) -> None:
        if copy.asked_by is None:
            self.service.warm.discard(copy)


class KVRouteHost(Protocol):
    """What admitting a KV copy stream needs of the worker (worker/server/app.py's runtime)."""

    @property
    def link_secret(self) -> str: ...

    @property
    def copy_service(self) -> KVCopyHost | None: ...

    @property
    def draining(self) -> asyncio.Event: ...


class KVCopyAcceptor:
    """The `/v1/kv` route: the link secret, as the link's (worker/server/link.py)."""

    def __init__(self, host: KVRouteHost) -> None:
        self.host = host

    async def accept(self, websocket: WebSocket) -> None:
        service = self.host.copy_service
        if await refused(
            websocket, self.host.link_secret, serving=service is not None, draining=self.host.draining
        ):
            return
        assert service is not None
        await websocket.accept()
        await KVReceiver(websocket, service).serve()
