"""API keys, per-key limits and browser tokens on a real stack (issue 12).

A real redis-server, two workers and two gateways with `--auth on`, as processes on loopback. Keys
are created with the real `microturn keys` command where the command is what is under test, and
through `KeyStore` elsewhere (the same code the command runs). No timing assertions: where a test
waits for something that happens on a timer (a lease lapsing, a session expiring), it polls with a
generous bound and asserts what happened, not how fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect

from gateway.auth.api_keys import KeyStore
from gateway.handshake import BEARER_SUBPROTOCOL_PREFIX
from shared.client.clients import ConnectionLost, RealtimeClient
from shared.client.retry import NO_RETRY
from shared.errors import ErrorCode, RateLimited, SessionNotFound, WorkerUnavailable
from shared.protocol.close_codes import close_code_for
from shared.protocol.codec import Encoding, decode_server, encode_client
from shared.protocol.key_limits import KeyLimits
from shared.protocol.messages import Error, InputChunk, SessionExpiring, SessionOpen, SessionResume
from shared.store.schema import SESSION_CREATED_MS, KeySchema
from tests.conftest import Servers
from tests.processes import REPO
from tests.system.gateway.stack import Proc, Stack, stop
from tests.wait import await_until

T = TypeVar("T")
TEST_TIMEOUT_S = 120.0
AUTH_ON = ["--auth", "on", "--open-timeout-s", "20"]
WORKER_FLAGS = ["--max-sessions", "32", "--kv-tokens", "8192", "--heartbeat-s", "0.5"]
CHUNK = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def stack(servers: Servers) -> Stack:
    return servers.stack(worker_flags=WORKER_FLAGS, gateway_flags=AUTH_ON)


def run(stack: Stack, body: Callable[[KeyStore], Coroutine[Any, Any, T]]) -> T:
    async def main() -> T:
        redis = Redis.from_url(stack.redis_url, decode_responses=False)
        try:
            return await asyncio.wait_for(body(KeyStore(redis, KeySchema(stack.prefix))), TEST_TIMEOUT_S)
        finally:
            await redis.aclose()

    return asyncio.run(main())


def new_name() -> str:
    return f"k{uuid.uuid4().hex[:8]}"


async def turn(client: RealtimeClient, seq: int) -> None:
    done = await client.turn(seq=seq, tokens=CHUNK, max_output_tokens=2)
    assert done.seq == seq and len(done.tokens) == 2


async def open_answer(client: RealtimeClient) -> Any:
    """Send `session.open` and return the first answer. An unauthorized socket is closed right after
    its error, so the send may find it closed already: the error is still there to be read."""
    with contextlib.suppress(ConnectionLost):
        await client.send(SessionOpen())
    return await client.recv()


async def expect_refusal(url: str, code: ErrorCode, *, api_key: str | None = None) -> Error:
    """Open through `url` and expect an `error` with `code`; returns it."""
    async with await RealtimeClient.connect(url, api_key=api_key) as client:
        message = await open_answer(client)
        assert isinstance(message, Error), message
        assert message.code == code, message
        return message


async def open_once_a_slot_frees(client: RealtimeClient, attempts: int = 30) -> None:
    """Open, as a client does on a key whose slot a dropped socket frees: the gateway that held the
    session frees the slot once it reads the close, after the client's disconnect has returned, so an
    open through another gateway may be refused until then (`rate_limited`, not fatal, with
    `retry_after_ms`): wait that long and open again on the same socket. Fails if no slot frees."""
    for _ in range(attempts):
        try:
            await client.open()
            return
        except RateLimited as refused:
            assert refused.retry_after_ms is not None and refused.retry_after_ms > 0
            await asyncio.sleep(refused.retry_after_ms / 1000)
    await client.open()


def http_post(url: str, body: bytes | None, key: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body or b"", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def mint(gateway: Proc, key: str, **limits: Any) -> str:
    status, body = http_post(gateway.http + "/v1/client_tokens", json.dumps(limits).encode(), key)
    assert status == 200, body
    assert body["expires_at"] > 0
    token: str = body["token"]
    return token


# ---- credentials ------------------------------------------------------------------------------------


def test_no_wrong_or_revoked_credential_is_unauthorized_with_one_answer(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        url = stack.realtime_url(0)
        secret, _ = await keys.create(new_name(), KeyLimits())
        answers = []
        for presented in (None, "mt_not-a-key", "mtb_not-a-token", secret + "x"):
            async with await RealtimeClient.connect(url, api_key=presented) as client:
                refused = await open_answer(client)
                assert isinstance(refused, Error) and refused.code == ErrorCode.UNAUTHORIZED and refused.fatal
                answers.append(refused.message)
                await asyncio.wait_for(client.ws.wait_closed(), 10)
                assert client.close_code == close_code_for(ErrorCode.UNAUTHORIZED) == 4011
        # The right key works, through either gateway.
        for gateway in (0, 1):
            async with await RealtimeClient.connect(stack.realtime_url(gateway), api_key=secret) as client:
                await client.open()
                await turn(client, 0)
                await client.close()
        assert await keys.revoke(_name_of(secret, await keys.list()))
        answers.append((await expect_refusal(url, ErrorCode.UNAUTHORIZED, api_key=secret)).message)
        # Missing, unknown, wrong and revoked all read the same: nothing says whether a key exists.
        assert len(set(answers)) == 1, answers

    run(stack, body)


def _name_of(secret: str, keys: list[Any]) -> str:
    from shared.store.values import sha256_hex

    return next(key.name for key in keys if key.digest == sha256_hex(secret))


def test_keys_command_creates_lists_and_revokes(stack: Stack) -> None:
    name = new_name()
    base = [sys.executable, "-m", "microturn", "keys"]
    where = ["--redis-url", stack.redis_url, "--key-prefix", stack.prefix]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*base, *args], check=False, capture_output=True, text=True, cwd=REPO, timeout=60
        )

    created = cli("create", *where, "--name", name, "--max-sessions", "3", "--max-session-s", "60")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("mt_")
    assert cli("create", *where, "--name", name).returncode == 1  # names are unique
    listed = cli("list", *where)
    assert listed.returncode == 0 and name in listed.stdout and secret not in listed.stdout

    async def body(keys: KeyStore) -> None:
        # Only the SHA-256 is stored: the secret appears nowhere in Redis.
        async for redis_key in keys.redis.scan_iter(match=f"{stack.prefix}:*"):
            assert secret.encode() not in redis_key
        key = await keys.by_secret(secret)
        assert key is not None and key.limits.max_sessions == 3
        async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as client:
            opened = await client.open()
            assert opened.limits["max_session_s"] == 60
            await client.close()

    run(stack, body)
    revoked = cli("revoke", *where, name)
    assert revoked.returncode == 0, revoked.stderr
    assert cli("revoke", *where, name).returncode == 1

    async def after(keys: KeyStore) -> None:
        await expect_refusal(stack.realtime_url(0), ErrorCode.UNAUTHORIZED, api_key=secret)

    run(stack, after)


# ---- concurrent sessions per key ------------------------------------------------------------------


def test_two_session_key_refuses_the_third_on_either_gateway_until_one_closes(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_sessions=2))
        first = await RealtimeClient.connect(stack.realtime_url(0), api_key=secret)
        second = await RealtimeClient.connect(stack.realtime_url(1), api_key=secret)
        try:
            for client in (first, second):
                await client.open()
                await turn(client, 0)
            for gateway in (0, 1):
                refused = await expect_refusal(
                    stack.realtime_url(gateway), ErrorCode.RATE_LIMITED, api_key=secret
                )
                assert not refused.fatal and refused.retry_after_ms is not None and refused.retry_after_ms > 0
            # A refused open leaves the socket usable: the same socket opens once a slot frees.
            async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as third:
                with pytest.raises(RateLimited):
                    await third.open()
                await first.close()
                await third.open()
                await turn(third, 0)
                # Ending the session by dropping the socket frees its slot too.
                await third.disconnect()
            async with await RealtimeClient.connect(stack.realtime_url(0), api_key=secret) as fourth:
                await open_once_a_slot_frees(fourth)
                await fourth.close()
        finally:
            await first.disconnect()
            await second.disconnect()

    run(stack, body)


def test_a_dead_gateway_frees_its_slots(stack: Stack) -> None:
    extra = stack.start_extra_gateway("gateway-doomed", [*AUTH_ON])
    extra_url = f"ws://127.0.0.1:{extra.port}/v1/realtime"

    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_sessions=1))
        client = await RealtimeClient.connect(extra_url, api_key=secret)
        await client.open()
        await turn(client, 0)
        await expect_refusal(stack.realtime_url(0), ErrorCode.RATE_LIMITED, api_key=secret)
        stop(extra, signal.SIGKILL)  # no release, no goodbye: only the lease can free the slot

        async def opens() -> bool:
            async with await RealtimeClient.connect(stack.realtime_url(0), api_key=secret) as other:
                try:
                    await other.open()
                except RateLimited:
                    return False
                await other.close()
                return True

        await await_until(opens, 30, "the dead gateway's slot to be freed")
        with contextlib.suppress(Exception):
            await client.disconnect()

    run(stack, body)


def test_a_dead_worker_keeps_the_slot_when_restored_and_frees_it_when_the_session_ends(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_sessions=1))
        client = await RealtimeClient.connect(stack.realtime_url(0), api_key=secret)
        opened = await client.open()
        await turn(client, 0)
        record = await keys.redis.hget(KeySchema(stack.prefix).session(opened.session_id), "worker")
        victim = record.decode()
        stop(stack.workers[victim], signal.SIGKILL)
        # The session moves to the other worker and still holds the key's only slot.
        for _ in range(40):
            try:
                done = await client.turn(seq=1, tokens=CHUNK, max_output_tokens=2, timeout=60)
                break
            except WorkerUnavailable as exc:  # the chunk raced the move: send it again
                await asyncio.sleep((exc.retry_after_ms or 250) / 1000)
        assert done.seq == 1
        await expect_refusal(stack.realtime_url(1), ErrorCode.RATE_LIMITED, api_key=secret)
        # Now the other worker dies too, with no worker left the session ends: the slot is free.
        survivor = next(w for w in stack.workers if w != victim)
        stop(stack.workers[survivor], signal.SIGKILL)
        with contextlib.suppress(Exception):
            await client.turn(seq=2, tokens=CHUNK, max_output_tokens=2, timeout=60)
        await asyncio.wait_for(client.ws.wait_closed(), 60)
        # Both back at once (the next tests want two workers): a boot is mostly one core's imports.
        await asyncio.gather(*(asyncio.to_thread(stack.start_worker, w) for w in (victim, survivor)))

        async def opens() -> bool:
            async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as other:
                try:
                    await other.open()
                except RateLimited:
                    return False
                await other.close()
                return True

        await await_until(opens, 30, "the ended session's slot to be freed")

    run(stack, body)


# ---- duration, budgets --------------------------------------------------------------------------


def test_a_session_past_its_duration_is_warned_then_expires_and_frees_its_slot(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_sessions=1, max_session_s=2.0))
        async with await RealtimeClient.connect(stack.realtime_url(0), api_key=secret) as client:
            opened = await client.open()
            await turn(client, 0)
            warning = await client.recv(timeout=30)
            assert isinstance(warning, SessionExpiring) and warning.reason == "max_duration"
            assert warning.session_id == opened.session_id
            expired = await client.recv(timeout=30)
            assert isinstance(expired, Error) and expired.code == ErrorCode.SESSION_EXPIRED and expired.fatal
            await asyncio.wait_for(client.ws.wait_closed(), 10)
            assert client.close_code == 4010
        # The expired session is gone (not resumable) and its slot is free. The gateway ends it after
        # the socket's close: until its record is gone, a resume is refused as expired (seen on a
        # loaded machine), so the resume waits for that, and an end that never came fails the wait.
        record = keys.schema.session(opened.session_id)

        async def ended() -> bool:
            return not await keys.redis.exists(record)

        await await_until(ended, 30, "the expired session to be ended")
        async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as again:
            # Ended on its worker, not merely dropped here: nothing is left to resume.
            with pytest.raises(SessionNotFound):
                await again.resume(opened.session_id, opened.resume_token)
        async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as fresh:
            await fresh.open()
            await fresh.disconnect()

    run(stack, body)


def test_a_spent_daily_budget_is_rate_limited(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, key = await keys.create(new_name(), KeyLimits(max_tokens_per_day=10))
        # Retries off: the client would resend the refused chunk 5 times, each after the capped wait
        # (shared/client/retry.py), 25 s before the refusal reached the test.
        url = stack.realtime_url(0)
        async with await RealtimeClient.connect(url, api_key=secret, retry=NO_RETRY) as client:
            await client.open()
            await turn(client, 0)  # 4 in + 2 out
            await turn(client, 1)  # 12: over the budget
            with pytest.raises(RateLimited) as refused:
                await client.turn(seq=2, tokens=CHUNK, max_output_tokens=2)
            assert refused.value.retry_after_ms is not None and refused.value.retry_after_ms > 0
        # Settled in a batch: the other gateway sees it within a refresh or two.

        async def settled() -> bool:
            return await keys.usage(key.digest) >= 12

        await await_until(settled, 30, "the usage to settle")
        refusal = await expect_refusal(stack.realtime_url(1), ErrorCode.RATE_LIMITED, api_key=secret)
        assert refusal.retry_after_ms is not None and refusal.retry_after_ms > 0

    run(stack, body)


# ---- browser tokens -----------------------------------------------------------------------------


async def open_with_token(url: str, token: str) -> tuple[Any, str | None, Any]:
    """A raw socket offering the bearer subprotocol, as a browser would; returns (ws, echoed, reply)."""
    ws = await connect(url, subprotocols=[Encoding.JSON.subprotocol, BEARER_SUBPROTOCOL_PREFIX + token])  # type: ignore[list-item]
    await ws.send(encode_client(SessionOpen(), Encoding.JSON))
    reply = decode_server(await asyncio.wait_for(ws.recv(), 30), Encoding.JSON)
    return ws, ws.subprotocol, reply


def test_browser_token_opens_exactly_one_session_that_ends_at_its_max_duration(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_session_s=600))
        gateway = stack.gateways[0]
        status, refused = http_post(gateway.http + "/v1/client_tokens", None, None)
        assert status == 401 and refused["error"]["code"] == "unauthorized"
        status, refused = http_post(gateway.http + "/v1/client_tokens", b'{"max_tokens": -1}', secret)
        assert status == 400 and refused["error"]["code"] == "invalid_message"
        token = mint(gateway, secret, max_session_s=2)
        ws, echoed, opened = await open_with_token(stack.realtime_url(1), token)
        try:
            assert echoed == Encoding.JSON.subprotocol  # the bearer subprotocol is never echoed
            assert opened.type == "session.opened", opened
            assert opened.limits["max_session_s"] == 2
            # The same token cannot open a second session, through either gateway.
            for index in (0, 1):
                other, _, reply = await open_with_token(stack.realtime_url(index), token)
                assert isinstance(reply, Error) and reply.code == ErrorCode.UNAUTHORIZED, reply
                await other.close()
            messages = [decode_server(await asyncio.wait_for(ws.recv(), 30), Encoding.JSON) for _ in range(2)]
            assert isinstance(messages[0], SessionExpiring) and messages[0].reason == "max_duration"
            assert isinstance(messages[1], Error) and messages[1].code == ErrorCode.SESSION_EXPIRED
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 4010
        finally:
            await ws.close()

    run(stack, body)


def test_browser_token_limits_are_capped_by_the_key_and_its_token_budget_is_enforced(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_session_s=30))
        gateway = stack.gateways[1]
        status, answer = http_post(
            gateway.http + "/v1/client_tokens",
            json.dumps({"max_session_s": 3600, "max_tokens": 20}).encode(),
            secret,
        )
        assert status == 200 and answer["limits"] == {"max_session_s": 30, "max_tokens": 20}
        ws, _, opened = await open_with_token(stack.realtime_url(0), answer["token"])
        try:
            assert opened.type == "session.opened", opened
            seen: list[Any] = []
            for seq in range(4):  # 6 tokens a turn: the 4th reaches 24 >= 20
                await ws.send(
                    encode_client(InputChunk(seq, tuple(CHUNK), max_output_tokens=2), Encoding.JSON)
                )
                while True:
                    message = decode_server(await asyncio.wait_for(ws.recv(), 30), Encoding.JSON)
                    seen.append(message)
                    if message.type in ("output.done", "error"):
                        break
                if message.type == "error":
                    break
            if not isinstance(seen[-1], Error):  # the turn that spends the budget finishes first
                seen.append(decode_server(await asyncio.wait_for(ws.recv(), 30), Encoding.JSON))
            kinds = [m.type for m in seen]
            assert kinds.count("output.done") == 4, kinds
            warnings = [m for m in seen if isinstance(m, SessionExpiring)]
            assert warnings and warnings[0].reason == "token_budget", kinds
            assert isinstance(seen[-1], Error) and seen[-1].code == ErrorCode.SESSION_EXPIRED, kinds
            await asyncio.wait_for(ws.wait_closed(), 10)
            assert ws.close_code == 4010
        finally:
            await ws.close()

    run(stack, body)


def test_racing_opens_through_both_gateways_admit_exactly_the_limit(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_sessions=3))
        clients = [await RealtimeClient.connect(stack.realtime_url(i % 2), api_key=secret) for i in range(10)]
        try:
            for client in clients:
                await client.send(SessionOpen())
            answers = [await client.recv() for client in clients]
            opened = [a for a in answers if a.type == "session.opened"]
            refused = [a for a in answers if isinstance(a, Error)]
            assert len(opened) == 3, answers
            assert len(refused) == 7 and {a.code for a in refused} == {ErrorCode.RATE_LIMITED}
        finally:
            for client in clients:
                await client.disconnect()

    run(stack, body)


def test_resume_needs_the_same_key_and_keeps_the_session_clock(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_sessions=1, max_session_s=600))
        other, _ = await keys.create(new_name(), KeyLimits())
        first = await RealtimeClient.connect(stack.realtime_url(0), api_key=secret)
        opened = await first.open()
        await turn(first, 0)
        await first.disconnect()  # the session stays resumable; its slot goes with the socket
        async with await RealtimeClient.connect(stack.realtime_url(1), api_key=other) as thief:
            with contextlib.suppress(ConnectionLost):
                await thief.send(SessionResume(opened.session_id, opened.resume_token, 0))
            refused = await thief.recv()
            assert isinstance(refused, Error) and refused.code == ErrorCode.UNAUTHORIZED
        async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as again:
            resumed = await again.resume(opened.session_id, opened.resume_token, 0)
            assert resumed.last_seq == 0
            await turn(again, 1)
            # Resumed, it holds the key's only slot again.
            await expect_refusal(stack.realtime_url(0), ErrorCode.RATE_LIMITED, api_key=secret)
            await again.close()

    run(stack, body)


def test_a_browser_token_resumes_its_own_session_only(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits())
        token = mint(stack.gateways[0], secret, max_session_s=600)
        ws, _, opened = await open_with_token(stack.realtime_url(0), token)
        assert opened.type == "session.opened", opened
        await ws.close()
        resume = SessionResume(opened.session_id, opened.resume_token)
        ws = await connect(
            stack.realtime_url(1),
            subprotocols=[BEARER_SUBPROTOCOL_PREFIX + token, Encoding.JSON.subprotocol],  # type: ignore[list-item]
        )
        try:
            assert ws.subprotocol == Encoding.JSON.subprotocol  # the encoding echoed, never the bearer
            await ws.send(encode_client(resume, Encoding.JSON))
            reply = decode_server(await asyncio.wait_for(ws.recv(), 30), Encoding.JSON)
            assert reply.type == "session.resumed", reply
        finally:
            await ws.close()

    run(stack, body)


def test_a_token_is_claimed_by_one_session_and_given_back_only_by_it(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        from gateway.auth.client_tokens import ClientTokenStore

        _, key = await keys.create(new_name(), KeyLimits())
        tokens = ClientTokenStore(keys.redis, keys.schema)
        secret, token = await tokens.mint(key, KeyLimits(), ttl_s=60)
        assert await tokens.claim(token, "s1", 120) and await tokens.claim(token, "s1", 120)
        assert not await tokens.claim(token, "s2", 120)
        await tokens.unclaim(token, "s2")  # not the claimant: no effect
        assert not await tokens.claim(token, "s2", 120)
        await tokens.unclaim(token, "s1")  # s1 never opened: the token can start a session again
        back = await tokens.by_secret(secret)
        assert back is not None and back.sid is None
        assert await tokens.claim(token, "s2", 120)

    run(stack, body)


async def redis_now_ms(redis: Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_session_resumed_near_its_end_is_warned_at_once_then_expires(stack: Stack) -> None:
    """Its record says it was created 28 s ago (the time its 30 s count from, set there rather than
    waited for): the resume lands inside the warning window, the last 20 % of its life."""

    async def body(keys: KeyStore) -> None:
        secret, _ = await keys.create(new_name(), KeyLimits(max_session_s=30.0))
        first = await RealtimeClient.connect(stack.realtime_url(0), api_key=secret)
        opened = await first.open()
        await first.disconnect()
        record = keys.schema.session(opened.session_id)
        await keys.redis.hset(record, SESSION_CREATED_MS, await redis_now_ms(keys.redis) - 28_000)
        async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as again:
            await again.resume(opened.session_id, opened.resume_token)
            warning = await again.recv(timeout=30)
            assert isinstance(warning, SessionExpiring) and warning.reason == "max_duration", warning
            assert warning.expires_in_ms is not None and 0 < warning.expires_in_ms <= 2000
            expired = await again.recv(timeout=30)
            assert isinstance(expired, Error) and expired.code == ErrorCode.SESSION_EXPIRED, expired

    run(stack, body)


def test_a_live_session_keeps_its_slot_past_the_lease(stack: Stack) -> None:
    from gateway.auth.key_ledger import LEASE_S

    async def body(keys: KeyStore) -> None:
        secret, key = await keys.create(new_name(), KeyLimits(max_sessions=1))
        async with await RealtimeClient.connect(stack.realtime_url(0), api_key=secret) as client:
            opened = await client.open()
            zset = keys.schema.key_sessions(key.digest)
            first_lease_end = await keys.redis.zscore(zset, opened.session_id)
            assert first_lease_end is not None

            async def first_lease_over() -> bool:  # by the clock the leases are scored on
                return await redis_now_ms(keys.redis) > first_lease_end

            # Past the lease it was admitted with: only the gateway's batched renewals keep it now.
            await await_until(first_lease_over, LEASE_S + 30, "the session's first lease to run out")
            await turn(client, 0)
            members = await keys.redis.zrange(zset, 0, -1)
            assert members == [opened.session_id.encode()]
            renewed = await keys.redis.zscore(zset, opened.session_id)
            assert renewed is not None and renewed > first_lease_end
            await expect_refusal(stack.realtime_url(1), ErrorCode.RATE_LIMITED, api_key=secret)
            await client.close()
            lease_end_ms = await keys.redis.zscore(zset, opened.session_id)

        async def released() -> bool:
            return await keys.redis.zcard(zset) == 0

        await await_until(released, 30, "the lease to be released")
        # Removed by the close, not lapsed: the Redis clock had not reached the lease's end yet.
        assert lease_end_ms is None or await redis_now_ms(keys.redis) < lease_end_ms

    run(stack, body)


def test_revoking_refuses_the_next_open_even_on_a_socket_already_in(stack: Stack) -> None:
    async def body(keys: KeyStore) -> None:
        name = new_name()
        secret, _ = await keys.create(name, KeyLimits(max_sessions=1))
        async with await RealtimeClient.connect(stack.realtime_url(0), api_key=secret) as first:
            await first.open()
            async with await RealtimeClient.connect(stack.realtime_url(1), api_key=secret) as second:
                with pytest.raises(RateLimited):
                    await second.open()
                assert await keys.revoke(name)
                refused = await open_answer(second)
                assert isinstance(refused, Error) and refused.code == ErrorCode.UNAUTHORIZED and refused.fatal
            # The session opened before the revocation runs on until it ends.
            await turn(first, 0)
            await first.close()

    run(stack, body)
