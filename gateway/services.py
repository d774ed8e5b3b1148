"""What every client session of one gateway shares: settings, Redis, the link pool, metrics.

Why a container: the app's lifespan creates these once and each socket handler gets the same
object, so handlers need no globals and a test can build one around its own Redis and pool.
Nothing in here is per-session; the gateway holds no session state beyond its live sockets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway.auth.api_keys import KeyStore
from gateway.auth.client_tokens import ClientTokenStore
from gateway.auth.credentials import Authenticator
from gateway.auth.key_ledger import KeyLedger
from gateway.auth.session_auth import AuthDeps
from gateway.limits import LimitValues
from gateway.links import LinkPool
from gateway.metrics import GatewayMetrics
from gateway.session_store import SessionStore
from shared.settings import GatewaySettings
from shared.store.schema import KeySchema


@dataclass
class GatewayServices:
    settings: GatewaySettings
    redis: Redis
    pool: LinkPool
    metrics: GatewayMetrics
    schema: KeySchema = field(init=False)
    store: SessionStore = field(init=False)
    limits: LimitValues = field(init=False)
    # Both None when auth is off (`--auth off`): every socket is let in, nothing is counted.
    authenticator: Authenticator | None = field(init=False, default=None)
    auth: AuthDeps | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.schema = KeySchema(self.settings.key_prefix)
        self.store = SessionStore(
            self.redis, self.schema, self.settings.session_grace_s, self.settings.idle_timeout_s
        )
        self.limits = LimitValues.from_settings(self.settings)
        if self.settings.auth_required:
            keys = KeyStore(self.redis, self.schema)
            tokens = ClientTokenStore(self.redis, self.schema)
            self.authenticator = Authenticator(keys, tokens, self.settings.client_token_ttl_s)
            ledger = KeyLedger(self.redis, self.schema, keys)
            self.auth = AuthDeps(
                self.schema, ledger, tokens, self.settings.idle_timeout_s + self.settings.session_grace_s
            )
        self.store.suspects = self.pool.suspects
        self.pool.on_suspect = self._publish_suspect
        self._background: set[asyncio.Task[None]] = set()

    async def _suspect_everywhere(self, worker_id: str) -> None:
        if await self.store.mark_suspect(worker_id):
            self.pool.trust(worker_id)  # Redis holds the suspicion now, for every gateway

    def _publish_suspect(self, worker_id: str) -> None:
        """Tell the other gateways (a Redis key placement honours); never blocks the link reader."""
        task = asyncio.get_running_loop().create_task(self._suspect_everywhere(worker_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
