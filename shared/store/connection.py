"""One way to build a Redis client that survives a Redis restart (NOTES "Redis clients after a
server restart").

Why: redis-py's asyncio pool keeps its connections; after the server restarts each stale one fails
its first command with `ConnectionError`. Without retries the gateway answered the next opens with
`worker_unavailable` and the worker logged a failure per flush. With `Retry` the failing command
reconnects and runs again (backoff capped well under a heartbeat), and `health_check_interval`
PINGs a connection that sat idle longer than that before using it, so a stale one is replaced
before a client's command rides on it. Neither runs on the per-chunk path: Redis is never called
per chunk (docs/design.md section 1).
"""

from __future__ import annotations

import logging
from typing import Final, cast
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

# Three retries at 50, 100, 200 ms (capped at 500 ms): a restart that takes longer than that is an
# outage, which callers handle (a typed error to the client, a retried flush on the worker).
RETRIES: Final = 3
BACKOFF_BASE_S: Final = 0.05
BACKOFF_CAP_S: Final = 0.5
# An idle pooled connection is PINGed before use after this long: cheap, and never per chunk.
HEALTH_CHECK_INTERVAL_S: Final = 2
CONNECT_TIMEOUT_S: Final = 2.0
SOCKET_TIMEOUT_S: Final = 10.0


def resilient_redis(url: str, mode: str = "standalone") -> Redis:
    """A client (binary replies: the token log is bytes) that reconnects after a server restart.

    `mode` "cluster": redis-py's `RedisCluster`, seeded by `url` (any node; TLS, user and password
    from the URL as in standalone). It routes each command by its key's slot and follows MOVED/ASK
    after a failover; every script and MULTI here touches one slot (shared/store/schema.py), so the
    rest of the code uses it as it uses `Redis` (hence the one static type).
    """
    if mode == "cluster":
        cluster = RedisCluster.from_url(
            url,
            decode_responses=False,
            retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
        )
        return cast(Redis, cluster)  # the command API this project uses is the same on both
    return Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
    )


class OutageLog:
    """Logs one line when a Redis-backed duty starts failing and one when it recovers.

    Why: a worker flushes every ~20 ms; a traceback per failed try buried the logs (about 75 in 2 s
    of outage). The first failure of an outage is a warning with the error's text, the rest are
    counted, and recovery says how many tries failed.
    """

    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self._log = log
        self.failures = 0  # in the current outage
        self.outages = 0

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failed(self, exc: BaseException) -> None:
        if self.failures == 0:
            self.outages += 1
            self._log.warning(
                "%s failed (%s: %s); retrying quietly until Redis answers", self.what, type(exc).__name__, exc
            )
        self.failures += 1

    def succeeded(self) -> None:
        if self.failures:
            self._log.warning("%s works again after %d failed tries", self.what, self.failures)
            self.failures = 0


def redacted_url(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
