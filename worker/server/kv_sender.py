"""The sending end of a drain's KV copy: a session's pages, to the worker taking it over.

switchover.py places each session, then hands it to a `KVSender` of its target: a few streams per
target (`/v1/kv`, dialed with the link secret by the link's own client), each carrying its sessions
one after the other. Per session the engine gathers the KV out of the tier that holds it
(`Engine.export_kv`: on CUDA through pinned memory on the host tier's side stream, never blocking a
step), the payload is checksummed off the event loop, and the stream carries header, pages and the
target's answer (shared/protocol/kv_copy.py). The session is served here throughout: the copy is a
snapshot at a turn boundary of the engine thread, and the target catches up on later turns from the
log.

The outcome is `stored` or the reason the target rebuilds the copy from the log instead (a format
mismatch, a bad checksum, a broken stream, no room): the caller then asks for the copy with `warm`
either way, and counts the fallback. Nothing here can cost a turn: the session only moves at the
switch, once the target answered `warmed`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import websockets
from websockets.asyncio.client import ClientConnection

from shared.errors import InvalidMessage, MicroturnError
from shared.protocol.kv_copy import (
    KV_COPY_PATH,
    KV_FRAME_BYTES,
    KV_FRAME_PAGES,
    KV_MAX_FRAME_BYTES,
    FallbackReason,
    KVHeader,
    KVReady,
    KVRefused,
    KVStored,
    checksum,
    decode_kv,
    encode_kv,
)
from shared.protocol.link_client import dial
from shared.protocol.messages import OpenConfig
from worker.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyOutcome:
    sid: str
    # None: the target stored the copy; else why it rebuilds it from the log instead.
    fallback: FallbackReason | None
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""


class KVSender:
    """This worker's KV copy stream to one target worker."""

    def __init__(self, engine: Engine, worker_id: str, url: str, *, secret: str, timeout_s: float) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.url = url
        self.secret = secret
        self.timeout_s = timeout_s
        self.connection: ClientConnection | None = None
        self.broken = False

    async def send(self, sid: str, config: OpenConfig) -> CopyOutcome:
        """Copy the session's KV to the target; never raises."""
        started = time.monotonic()
        if self.broken:
            return CopyOutcome(sid, "stream", detail="the stream broke on an earlier session")
        try:
            export = await asyncio.wrap_future(self.engine.export_kv(sid))
        except MicroturnError as exc:  # the session ended here meanwhile
            return CopyOutcome(sid, "refused", detail=str(exc))
        try:
            connection = await self._connection()
            payload = await asyncio.to_thread(export.payload)  # CUDA: waits for the gather's event
            page_bytes = self.engine.kv_format.page_bytes
            step = max(min(KV_FRAME_PAGES, KV_FRAME_BYTES // page_bytes), 1) * page_bytes
            frames = [payload[i : i + step] for i in range(0, len(payload), step)]
            crc = await asyncio.to_thread(checksum, frames)
            header = KVHeader(sid, self.engine.kv_format, tuple(export.tokens), export.pages, crc, config)
            await connection.send(encode_kv(header))
            answer = await self._answer(connection, sid)
            if isinstance(answer, KVReady):
                for frame in frames:
                    await connection.send(frame)
                answer = await self._answer(connection, sid)
        except (OSError, TimeoutError, websockets.WebSocketException, InvalidMessage) as exc:
            self.broken = True
            return CopyOutcome(sid, "stream", detail=f"{type(exc).__name__}: {exc}")
        seconds = time.monotonic() - started
        if isinstance(answer, KVRefused):
            return CopyOutcome(sid, answer.reason, seconds=seconds, detail=answer.detail)
        if not isinstance(answer, KVStored):
            self.broken = True
            return CopyOutcome(sid, "stream", detail=f"unexpected {answer.op}")
        return CopyOutcome(sid, None, len(payload), seconds)

    async def close(self) -> None:
        if self.connection is not None:
            await self.connection.close()

    async def _connection(self) -> ClientConnection:
        if self.connection is None:
            self.connection = await dial(
                self.url,
                secret=self.secret,
                open_timeout_s=self.timeout_s,
                path=KV_COPY_PATH,
                max_frame_bytes=KV_MAX_FRAME_BYTES,
            )
        return self.connection

    async def _answer(self, connection: ClientConnection, sid: str) -> KVReady | KVStored | KVRefused:
        frame = decode_kv(await connection.recv())
        if isinstance(frame, KVReady | KVStored | KVRefused) and frame.sid == sid:
            return frame
        raise InvalidMessage(f"KV copy of {sid}: the target answered {frame.op} for {frame.sid}")
