"""The gateway's links to workers: one multiplexed WebSocket per worker URL (docs/design.md section 4).

Why one link per worker and not one per client: a worker then holds a handful of sockets instead of
thousands, and a chunk costs one binary frame on an already open connection. The price is that the
link is shared, so everything here is written so that one session cannot stall another:

- Frames from the worker are decoded and handed to the session's listener *synchronously*, by
  `sid`; listeners only enqueue (they never await), so a slow client never blocks the reader.
- Links open lazily on first use. A failed connect makes the next attempts wait an exponentially
  growing delay; callers during that delay get `WorkerUnavailable` at once (they place the session
  elsewhere) instead of piling up on a dead worker.
- When a link breaks, every session bound to it is told (`on_link_lost`), exactly once, and its
  binding is removed; the session restores itself on another worker (client_session.py).
- A worker whose link broke or cannot be reached is *suspect* at once (docs/failover.md): this
  gateway's placement skips it for `SUSPECT_TTL_S`, and `on_suspect` tells the other gateways
  (a short-lived Redis key that placement honours), so a restore lands elsewhere on the first try.

Bindings live in the pool, not in the link: a session is bound to exactly one (listener, link)
pair on this gateway. A frame that arrives on any other link for that sid (e.g. the old worker's
`closed(idle_timeout)` for a session that was since restored elsewhere) is stale and dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from shared.errors import InvalidMessage, WorkerUnavailable
from shared.protocol.link import LinkError, ToGateway, ToWorker
from shared.protocol.link_client import dial, link_endpoint
from shared.protocol.link_codec import decode_link, encode_link
from shared.store.placement import SUSPECT_TTL_S

logger = logging.getLogger(__name__)

# Delay before the next connect attempt after n consecutive failures: BASE * 2**(n-1), capped.
BACKOFF_BASE_S: Final = 0.1
BACKOFF_MAX_S: Final = 5.0


class LinkListener(Protocol):
    """What a client session implements to receive its worker's frames. No method may await."""

    def on_frame(self, frame: ToGateway) -> None: ...

    def on_link_lost(self, link: Link) -> None:
        """The link broke; the binding is already gone. Called at most once per binding."""

    def on_taken_over(self) -> None:
        """Another socket on this gateway bound the same session; the binding is already gone."""


class Link:
    """One WebSocket to one worker, shared by every session this gateway has there."""

    def __init__(self, pool: LinkPool, url: str, worker_id: str = "") -> None:
        self.url = url
        self.worker_id = worker_id  # "" until a caller names it: such a link is never suspected
        self.endpoint = link_endpoint(url)
        self._pool = pool
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._failures = 0
        self._retry_at = 0.0
        self._ever_connected = False

    async def send(self, frame: ToWorker) -> None:
        """Send one frame, connecting first if needed; raises `WorkerUnavailable` on any failure."""
        ws = self._ws if self._ws is not None else await self._connect()
        try:
            await ws.send(encode_link(frame))
        except ConnectionClosed as exc:
            # The reader sees the same close and notifies the bound sessions; the caller only learns
            # that this frame may not have arrived.
            raise WorkerUnavailable(f"link to {self.url} broke while sending") from exc

    async def _connect(self) -> ClientConnection:
        async with self._lock:  # one connect attempt at a time; waiters reuse its result
            if self._ws is not None:
                return self._ws
            metrics = self._pool.metrics
            wait_s = self._retry_at - time.monotonic()
            if wait_s > 0:
                raise WorkerUnavailable(
                    f"link to {self.url} is down; next attempt in {wait_s:.1f} s",
                    retry_after_ms=max(1, round(wait_s * 1000)),
                )
            try:
                ws = await dial(
                    self.url, secret=self._pool.link_secret, open_timeout_s=self._pool.connect_timeout_s
                )
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                self._failures += 1
                delay = min(BACKOFF_BASE_S * 2 ** (self._failures - 1), BACKOFF_MAX_S)
                self._retry_at = time.monotonic() + delay
                metrics.count(Metric.LINK_FAILURES)
                self._pool.suspect(self.worker_id)
                logger.warning(
                    "link to %s failed (%s: %s); attempt %d, next in %.1f s",
                    self.endpoint,
                    type(exc).__name__,
                    exc,
                    self._failures,
                    delay,
                )
                raise WorkerUnavailable(
                    f"cannot reach worker at {self.url}", retry_after_ms=round(delay * 1000)
                ) from exc
            self._failures = 0
            self._retry_at = 0.0
            self._pool.trust(self.worker_id)
            metrics.count(Metric.LINK_CONNECTS)
            if self._ever_connected:
                metrics.count(Metric.LINK_RECONNECTS)
            self._ever_connected = True
            self._ws = ws
            self._reader = asyncio.create_task(self._read(ws), name=f"link-reader {self.url}")
            logger.info("link to %s open", self.endpoint)
            return ws

    async def _read(self, ws: ClientConnection) -> None:
        # A worker that closes the link itself (a drain: uvicorn's 1012 "service restart") is alive
        # and already out of placement (`draining`); one that vanished sent no close frame.
        graceful = False
        try:
            async for data in ws:
                try:
                    frame = decode_link(data)
                except InvalidMessage as exc:
                    # A version skew or a worker bug: say so loudly, but keep the other sessions going.
                    logger.error("undecodable frame from %s: %s", self.url, exc.message)
                    continue
                if not isinstance(frame, ToGateway):
                    logger.error("worker %s sent a gateway-side op %r", self.url, frame.op)
                    continue
                self._pool.dispatch(self, frame)
        except ConnectionClosed as exc:
            graceful = exc.rcvd is not None
            logger.warning("link to %s closed: %s", self.url, exc)
        except Exception:
            logger.exception("link reader for %s crashed", self.url)
        finally:
            if self._ws is ws:
                self._ws = None
                await ws.close()
                if not self._pool.closing:
                    self._pool.metrics.count(Metric.LINK_FAILURES)
                    self._pool.link_lost(self, suspect=not graceful)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


class LinkPool:
    """Every link of this gateway, and which session listens on which link."""

    def __init__(self, metrics: GatewayMetrics, *, link_secret: str = "", connect_timeout_s: float = 5.0):
        self.metrics = metrics
        self.link_secret = link_secret
        self.connect_timeout_s = connect_timeout_s
        self.closing = False
        self._links: dict[str, Link] = {}
        self._bindings: dict[str, tuple[LinkListener, Link]] = {}
        # worker id -> monotonic time its suspicion lapses
        self._suspects: dict[str, float] = {}
        # Called (synchronously; it must not block) when a worker becomes suspect here.
        self.on_suspect: Callable[[str], None] | None = None

    def link(self, url: str, worker_id: str = "") -> Link:
        """The link for a worker URL (created, not yet connected, on first use)."""
        link = self._links.get(url)
        if link is None:
            link = self._links[url] = Link(self, url, worker_id)
        elif worker_id:
            link.worker_id = worker_id  # a worker restarted on the same URL under another id
        return link

    def suspect(self, worker_id: str) -> None:
        """Stop placing sessions on `worker_id` from this gateway at once, and tell the others."""
        if not worker_id or self.closing:
            return
        fresh = self._suspects.get(worker_id, 0.0) <= time.monotonic()
        self._suspects[worker_id] = time.monotonic() + SUSPECT_TTL_S
        if fresh:
            logger.warning("worker %s is suspect: no placements on it for %.0f s", worker_id, SUSPECT_TTL_S)
            self.metrics.count(Metric.WORKERS_SUSPECTED)
            if self.on_suspect is not None:
                self.on_suspect(worker_id)

    def trust(self, worker_id: str) -> None:
        """A link to `worker_id` just opened (it is alive), or its suspect key is now in Redis (which
        a fresh registration of the worker clears: the local mark must not outlive that)."""
        self._suspects.pop(worker_id, None)

    def suspects(self) -> list[str]:
        """The workers this gateway suspects now (their suspicion has not lapsed)."""
        now = time.monotonic()
        for worker_id in [w for w, until in self._suspects.items() if until <= now]:
            del self._suspects[worker_id]
        return list(self._suspects)

    def bind(self, sid: str, listener: LinkListener, link: Link) -> None:
        """Route `sid`'s frames from `link` to `listener`. Bind *before* sending open/attach/restore,
        so the answer cannot arrive unrouted. A different listener bound to `sid` is taken over."""
        previous = self._bindings.get(sid)
        self._bindings[sid] = (listener, link)
        if previous is not None and previous[0] is not listener:
            previous[0].on_taken_over()

    def unbind(self, sid: str, listener: LinkListener) -> bool:
        """Remove `listener`'s binding of `sid`; False (and nothing done) if it is not the bound one."""
        current = self._bindings.get(sid)
        if current is None or current[0] is not listener:
            return False
        del self._bindings[sid]
        return True

    def bound_link(self, sid: str, listener: LinkListener) -> Link | None:
        current = self._bindings.get(sid)
        return current[1] if current is not None and current[0] is listener else None

    @property
    def sessions(self) -> int:
        return len(self._bindings)

    def dispatch(self, link: Link, frame: ToGateway) -> None:
        if not frame.sid:
            if isinstance(frame, LinkError):
                error = frame.error
                logger.error("worker %s reports a link error: %s %s", link.url, error.code, error.message)
            return
        current = self._bindings.get(frame.sid)
        if current is None or current[1] is not link:
            # Nobody here listens for it on this link: the client detached, or the session moved.
            logger.debug("dropping %s for unbound session %s from %s", frame.op, frame.sid, link.url)
            return
        try:
            current[0].on_frame(frame)
        except Exception:
            logger.exception("listener of session %s failed on %s", frame.sid, frame.op)

    def link_lost(self, link: Link, *, suspect: bool = True) -> None:
        if suspect:
            self.suspect(link.worker_id)
        lost = [(sid, b[0]) for sid, b in self._bindings.items() if b[1] is link]
        for sid, _ in lost:
            del self._bindings[sid]
        if lost:
            logger.warning("link to %s lost with %d session(s) bound", link.url, len(lost))
        for sid, listener in lost:
            try:
                listener.on_link_lost(link)
            except Exception:
                logger.exception("listener of session %s failed on link loss", sid)

    async def close(self) -> None:
        self.closing = True
        await asyncio.gather(*(link.close() for link in self._links.values()), return_exceptions=True)
        self._links.clear()
        self._bindings.clear()
