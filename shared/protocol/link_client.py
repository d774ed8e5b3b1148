"""Dialing a worker's link, as every peer of a worker does it: a gateway, and a draining worker.

One function opens the WebSocket (`dial`), so every client of a worker's `/v1/link` (and of its KV
copy stream, `/v1/kv`, a sibling route) sends the link secret the same way, keeps the connection
alive with the same pings, and bounds a frame the same way: a gateway's `Link` (gateway/links.py)
wraps it with reconnects and routing; a draining worker's `LinkClient` (worker/server/switchover.py
sends `warm`, worker/server/kv_sender.py the KV pages) uses it as it is.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Final

from websockets.asyncio.client import ClientConnection, connect

from shared.errors import InvalidMessage
from shared.protocol.link import LINK_PATH, LINK_SECRET_HEADER, LinkFrame, ToWorker
from shared.protocol.link_codec import decode_link, encode_link

logger = logging.getLogger(__name__)

# Link frames are small (a chunk, a turn's outputs); this only stops a broken peer from ballooning.
LINK_MAX_FRAME_BYTES: Final = 16 * 2**20
# Keepalive: a peer host that vanished without a FIN is noticed within interval + timeout.
LINK_PING_INTERVAL_S: Final = 5.0
LINK_PING_TIMEOUT_S: Final = 10.0


def link_endpoint(url: str, path: str = LINK_PATH) -> str:
    """The URL of a worker's route `path` for its registry `url` (its ws:// base URL; a URL that
    already ends with the path is kept)."""
    base = url.rstrip("/")
    if base.endswith(LINK_PATH):
        base = base[: -len(LINK_PATH)]
    return base if base.endswith(path) else base + path


def secret_headers(secret: str) -> dict[str, str]:
    """The handshake headers that carry `MT_LINK_SECRET` (none when it is unset)."""
    return {LINK_SECRET_HEADER: secret} if secret else {}


async def dial(
    url: str,
    *,
    secret: str,
    open_timeout_s: float,
    path: str = LINK_PATH,
    max_frame_bytes: int = LINK_MAX_FRAME_BYTES,
) -> ClientConnection:
    """Open the WebSocket to worker `url`'s route `path`; raises what `websockets.connect` raises
    (OSError, TimeoutError, InvalidHandshake, InvalidURI)."""
    return await connect(
        link_endpoint(url, path),
        additional_headers=secret_headers(secret),
        open_timeout=open_timeout_s,
        compression=None,  # small msgpack frames, or KV pages: deflate would cost more than it saves
        max_size=max_frame_bytes,
        ping_interval=LINK_PING_INTERVAL_S,
        ping_timeout=LINK_PING_TIMEOUT_S,
        proxy=None,
    )


class LinkClient:
    """One dialed link used as it is (no reconnect): frames out, frames in."""

    def __init__(self, worker_id: str, connection: ClientConnection) -> None:
        self.worker_id = worker_id
        self.connection = connection

    @classmethod
    async def open(cls, worker_id: str, url: str, *, secret: str, open_timeout_s: float) -> LinkClient:
        return cls(worker_id, await dial(url, secret=secret, open_timeout_s=open_timeout_s))

    async def send(self, frame: ToWorker) -> None:
        await self.connection.send(encode_link(frame))

    async def frames(self) -> AsyncIterator[LinkFrame]:
        """Every frame the worker sends, until the link closes (`ConnectionClosed` ends it); an
        undecodable one is logged and skipped, as a gateway does."""
        async for data in self.connection:
            if not isinstance(data, bytes):
                logger.error("worker %s sent a text frame on its link", self.worker_id)
                continue
            try:
                yield decode_link(data)
            except InvalidMessage as exc:
                logger.error("undecodable frame from worker %s: %s", self.worker_id, exc.message)

    async def close(self) -> None:
        await self.connection.close()
