"""Handing a worker's sessions over: to another worker on drain, and back to Redis after it lost its data.

Drain (SIGTERM, every deploy; docs/failover.md): the worker stops taking sessions, stops every
session here without answering for it again, makes its log durable, and tells each session's gateway
`migrate(sid, durable_seq)`. The gateway restores the session elsewhere as a planned restore, with
its undurable tail, exactly as after a crash: chunks this worker had in flight or queued are re-run
there, and each gets exactly one `done`. The order matters:

1. Unbind and forget each session *before* closing it in the engine: a turn the close cancels (or
   that finishes meanwhile) is then neither answered nor logged here, so it is still undelivered at
   the gateway and re-runs on the new worker. Turns answered before this point were logged.
2. Flush the log until Redis took it: the durable seq sent in `migrate` is then the whole history
   this worker answered.
3. Send `migrate` and wait until the links have written it. Sessions with no client attached keep
   their keys: their next resume restores them from the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Final

from shared.errors import WorkerUnavailable
from shared.protocol.codec import config_to_map
from shared.protocol.link import link_error_from
from shared.store.held import HeldSession
from shared.store.registry import SessionRecord
from worker.server.lifecycle import Phase
from worker.server.service import WorkerService

logger = logging.getLogger(__name__)

SEND_WAIT_S: Final = 5.0


def held_sessions(service: WorkerService) -> list[HeldSession]:
    """The record and whole log of every session held here, as Redis should hold them."""
    held: list[HeldSession] = []
    for binding, log in service.sessions.held():
        if binding.token_sha256 is None:
            continue  # opened by a gateway that sent no record: nothing to re-write it from
        record = SessionRecord(
            worker=service.worker_id,
            token_sha256=binding.token_sha256,
            model=service.engine.model_config.name,
            created_ms=binding.created_ms,
            config=config_to_map(binding.config),
            auth=binding.auth,
        )
        ttl_s = binding.idle_timeout_s + service.settings.session_grace_s
        held.append(HeldSession(binding.sid, record, log, ttl_s))
    return held


async def migrate_all(service: WorkerService, targets: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Drain: hand every session to its gateway for a planned restore; (migrated, left detached).
    `targets`: sessions with a copy already on another worker (worker/server/switchover.py), which
    `migrate` names so the gateway restores them there."""
    service.draining = True
    bindings = service.sessions.live()
    links = {}
    for binding in bindings:
        opening = binding.phase is Phase.OPENING
        link = service.sessions.hand_over(binding)
        if link is None:
            continue
        if opening:  # still opening: the gateway places it again (or elsewhere)
            link.send(link_error_from(binding.sid, WorkerUnavailable("worker is draining"), fatal=True))
            continue
        links[binding.sid] = link
    await asyncio.gather(
        *(asyncio.wrap_future(service.engine.close_session_async(b.sid, "closed")) for b in bindings)
    )
    await service.sessions.flush_durably()
    for binding in bindings:
        migrate = service.sessions.release(binding, (targets or {}).get(binding.sid))
        link = links.get(binding.sid)
        if link is not None:
            link.send(migrate)
    deadline = time.monotonic() + SEND_WAIT_S
    while any(getattr(link, "pending_frames", lambda: 0)() for link in links.values()):
        if time.monotonic() > deadline:
            logger.warning("drain: some migrate frames may not have reached their gateway")
            break
        await asyncio.sleep(0.01)
    logger.info(
        "drained: %d session(s) handed to their gateways, %d detached", len(links), len(bindings) - len(links)
    )
    return len(links), len(bindings) - len(links)
