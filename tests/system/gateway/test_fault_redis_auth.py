"""With auth on, a Redis that restarts empty costs a session neither its resume nor its limits.

The session record has one owner (shared/store/registry.py `SessionRecord`), the limits the session
was opened under included; the worker holding the session knows the whole record (the link's `open`
carried it) and re-writes it after Redis lost its data. Before, the gateway wrote the `auth_*`
fields on the side, the re-written record had none, and the resume was refused as `unauthorized`.

Real processes on loopback: redis-server (killed, restarted empty), one worker, one gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import pytest

from gateway.auth.api_keys import KeyStore
from shared.client import RealtimeClient
from shared.errors import ErrorCode
from shared.protocol.key_limits import KeyLimits
from shared.protocol.messages import Error, OutputDone, SessionExpiring
from shared.store.connection import resilient_redis
from shared.store.registry import read_session
from shared.store.schema import KeySchema
from tests.shared.redis_servers import ServerUnavailable
from tests.system.gateway.conftest import GATEWAY_FLAGS, WORKER_FLAGS
from tests.system.gateway.faults import restartable_redis
from tests.system.gateway.stack import running_stack
from tests.wait import await_until

# Long enough to open, stream, lose Redis and resume on a loaded 2-core machine (that took 1.0 s at
# load ~10, the stack already up); short enough that the test then sees the session end at this
# deadline, counted from its creation (the test waits it out: it was 20 s).
MAX_SESSION_S = 8.0
MAX_TOKENS = 100_000


def test_a_session_resumes_with_its_limits_after_redis_restarted_empty(tmp_path: Path) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    schema = KeySchema(prefix)
    try:
        server_cm = restartable_redis(tmp_path)
        server = server_cm.__enter__()
    except ServerUnavailable as exc:
        pytest.skip(str(exc))
    with contextlib.ExitStack() as exits:
        exits.callback(server_cm.__exit__, None, None, None)
        gateway_flags = [*GATEWAY_FLAGS, "--auth", "on"]
        stack = exits.enter_context(
            running_stack(
                server.url,
                prefix,
                tmp_path,
                workers=1,
                gateways=1,
                gateway_flags=gateway_flags,
                worker_flags=WORKER_FLAGS,
            )
        )

        async def body() -> None:
            redis = resilient_redis(server.url)  # reconnects after the restart
            try:
                limits = KeyLimits(max_session_s=MAX_SESSION_S, max_tokens_per_day=MAX_TOKENS)
                secret, key = await KeyStore(redis, schema).create("restart", limits)
                client = await RealtimeClient.connect(stack.realtime_url(0), api_key=secret)
                opened = await client.open()
                created = time.monotonic()
                for seq in range(1, 4):
                    done = await client.turn(seq=seq, tokens=[5, 6, 7], max_output_tokens=1)
                    assert isinstance(done, OutputDone)
                before = await read_session(redis, schema, opened.session_id)
                assert before is not None and before.auth is not None
                assert before.auth.key_sha256 == key.digest and before.auth.max_session_s == MAX_SESSION_S
                await client.disconnect()  # the session stays on its worker, detached
                # API keys are the operator's data, kept by persistence or restored from a backup;
                # the session record is ephemeral, and only the worker holding the session has it.
                key_index = await redis.hgetall(schema.api_keys())
                key_record = await redis.hgetall(schema.api_key(key.digest))

                server.kill()
                server.start()  # empty
                await redis.hset(schema.api_keys(), mapping=key_index)
                await redis.hset(schema.api_key(key.digest), mapping=key_record)

                async def rewritten() -> bool:  # the worker's next heartbeat re-writes what it holds
                    return await redis.exists(schema.session(opened.session_id)) == 1

                await await_until(rewritten, 30, "the worker to re-write the session record")
                after = await read_session(redis, schema, opened.session_id)
                assert after is not None
                assert after.auth == before.auth  # the limits came back with the record
                assert (after.token_sha256, after.created_ms) == (before.token_sha256, before.created_ms)

                client = await RealtimeClient.connect(stack.realtime_url(0), api_key=secret)
                resumed = await client.resume(opened.session_id, opened.resume_token, last_seq=3)
                assert resumed.last_seq == 3
                done = await client.turn(seq=4, tokens=[9], max_output_tokens=1)
                assert isinstance(done, OutputDone)
                # The duration limit still holds, counted from the session's creation, not the resume.
                warning = await client.recv(timeout=MAX_SESSION_S + 30)
                assert isinstance(warning, SessionExpiring) and warning.reason == "max_duration", warning
                with contextlib.suppress(Exception):
                    expired = await client.recv(timeout=MAX_SESSION_S + 30)
                    assert isinstance(expired, Error) and expired.code == ErrorCode.SESSION_EXPIRED, expired
                assert time.monotonic() - created < 2 * MAX_SESSION_S + 30
            finally:
                await redis.aclose()

        asyncio.run(asyncio.wait_for(body(), 120))
