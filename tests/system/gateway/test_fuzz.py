"""10,000 malformed frames over both subprotocols against a live gateway.

What must hold: no `internal` answer, no socket dropped (1006) or failed (1011), every socket still
answers a ping afterwards, and a bystander session on the same worker gets exactly the outputs of
an undisturbed session. The frames: wrong types for every field of every client message (and of
the open config), lone surrogates (JSON `\\ud800` escapes; invalid UTF-8 in msgpack strings) in
every string position including keys and ping data, huge and non-finite numbers, binary frames on
JSON and text frames on msgpack, truncated and random bytes, deep nesting, duplicate keys.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import msgpack
import pytest

from shared.client.clients import ConnectionLost, RealtimeClient
from shared.errors import ErrorCode
from shared.protocol.messages import Error, Pong
from tests.conftest import Servers
from tests.system.gateway.conftest import LINK_SECRET
from tests.system.gateway.stack import Stack

FRAMES = 10_000
SOCKETS = 4  # two per subprotocol
BATCH = 250  # frames between two ping markers
CONFIG = {"max_output_tokens": 2, "stop_token_ids": []}

MESSAGES: dict[str, dict[str, object]] = {
    "session.open": {"config": {}},
    "session.resume": {"session_id": "s", "resume_token": "t", "last_seq": 1},
    "input.chunk": {
        "seq": 1,
        "tokens": [1],
        "text": "a",
        "max_output_tokens": 1,
        "logprobs": True,
        "flush": True,
    },
    "output.cancel": {"seq": 1},
    "session.close": {"reason": "x"},  # an unknown field: a plain close would end the fuzzed session
    "ping": {"data": 1},
}
CONFIG_FIELDS = [
    "max_output_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "logprobs",
    "idle_timeout_s", "max_context_tokens", "context_policy", "keep_prefix_tokens", "stream",
]  # fmt: skip
SURROGATES = ["\ud800", "a\udfffb", "\udc80", "ok\ud83d"]
WRONG: list[object] = [
    True, False, -1, -(2**63), 2**64 - 1, 1.5, -0.0, 1e308, "x", "", "A" * 3000, [], [1, "a"], [[-1]],
    {"a": 1}, {"": None}, [2**32], [-5, 3], {"nested": {"deeper": ["\ud800"]}}, *SURROGATES,
]  # fmt: skip
JSON_ONLY = ["1e999", "-1e999", "1" + "0" * 400, "NaN", "Infinity", "1.0e-400", "[" * 5000 + "]" * 5000]


def _json(obj: object) -> str:
    return json.dumps(obj)  # ensure_ascii: a lone surrogate is written as its \\udXXX escape


def _msgpack(obj: object) -> bytes:
    """msgpack with every lone surrogate written as the (invalid) UTF-8 bytes of its code point."""
    packed: bytes = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    return packed


def malformed(rng: random.Random, json_socket: bool) -> str | bytes:
    """One frame no server may answer with `internal` or a dropped socket."""
    kind = rng.randrange(10)
    name = rng.choice(list(MESSAGES))
    message: dict[str, object] = {"type": name, **MESSAGES[name]}
    if kind <= 3:  # a wrong value in one field (the config's fields included)
        if name == "session.open" and rng.random() < 0.7:
            message["config"] = {rng.choice(CONFIG_FIELDS): rng.choice(WRONG)}
        else:
            message[rng.choice([*MESSAGES[name], "type"])] = rng.choice(WRONG)
    elif kind == 4:  # a lone surrogate in a key or a string value
        where = rng.choice(["key", "type", "value", "config"])
        if where == "key":
            message[rng.choice(SURROGATES)] = 1
        elif where == "type":
            message["type"] = rng.choice(SURROGATES)
        elif where == "config":
            message = {"type": "session.open", "config": {rng.choice(SURROGATES): 1}}
        else:
            message = {"type": "input.chunk", "seq": 2, "text": rng.choice(SURROGATES)}
            if rng.random() < 0.5:
                message = {"type": "ping", "data": {"k": [rng.choice(SURROGATES)]}}
            if rng.random() < 0.3:
                message = {
                    "type": "session.resume",
                    "session_id": rng.choice(SURROGATES),
                    "resume_token": "t",
                }
    elif kind == 5:  # a frame of the other subprotocol
        frame = _msgpack(message) if json_socket else _json(message)
        return frame
    elif kind == 6:  # truncated or random bytes / text
        whole = _json(message) if json_socket else _msgpack(message)
        if rng.random() < 0.5:
            return whole[: rng.randrange(len(whole))]
        if json_socket:
            return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
    elif kind == 7:  # not a map, or a map without a type
        message = rng.choice([[1, 2], "ping", 3, None, {"data": 1}, {"type": None}])  # type: ignore[list-item]
    elif kind == 8 and json_socket:  # numbers JSON can write and nothing can hold
        field = rng.choice(["seq", "max_output_tokens", "data", "tokens"])
        text = _json({**message, field: 0}).replace(f'"{field}": 0', f'"{field}": {rng.choice(JSON_ONLY)}')
        if rng.random() < 0.2:
            text = '{"type": "ping", "type": "ping"}'  # a duplicate key
        return text
    elif kind == 8:  # msgpack: other key types, bin where a str belongs, ext types
        message = rng.choice(
            [
                {1: "ping"},
                {b"type": "ping"},
                {"type": b"ping"},
                {"type": "input.chunk", "seq": msgpack.ExtType(5, b"x"), "text": "a"},
            ]
        )  # type: ignore[assignment]
    else:  # an unknown field
        message[f"unknown_{rng.randrange(9)}"] = rng.choice(WRONG)
    return _json(message) if json_socket else _msgpack(message)


@pytest.fixture(scope="module")
def stack(servers: Servers) -> Stack:
    worker_flags = [*LINK_SECRET, "--kv-tokens", "65536"]
    return servers.stack(
        servers.redis("valkey"),
        workers=1,
        gateways=1,
        worker_flags=worker_flags,
        gateway_flags=[*LINK_SECRET],
    )


def test_ten_thousand_malformed_frames_change_nothing(stack: Stack) -> None:
    url = stack.realtime_url(0)
    chunks = [[(7 * turn + i) % 500 for i in range(4)] for turn in range(1, 200)]

    async def bystander(done: asyncio.Event) -> list[tuple[int, ...]]:
        outputs: list[tuple[int, ...]] = []
        async with await RealtimeClient.connect(url, "msgpack") as client:
            await client.open(**CONFIG)
            for seq, chunk in enumerate(chunks, start=1):
                outputs.append((await client.turn(seq, tokens=chunk)).tokens)
                if done.is_set() and len(outputs) >= 5:
                    break
            await client.close()
        return outputs

    async def fuzz(index: int, answers: Counter[str], closes: list[int | None]) -> None:
        json_socket = index % 2 == 0
        rng = random.Random(index)
        sent = 0
        while sent < FRAMES // SOCKETS:
            async with await RealtimeClient.connect(url, "json" if json_socket else "msgpack") as client:
                await client.open(**CONFIG)
                try:
                    while sent < FRAMES // SOCKETS:
                        for _ in range(BATCH):
                            await client.send_raw(malformed(rng, json_socket))
                        sent += BATCH
                        marker = f"batch-{index}-{sent}"
                        await client.send_raw(
                            _json({"type": "ping", "data": marker})
                            if json_socket
                            else _msgpack({"type": "ping", "data": marker})
                        )
                        while True:
                            msg = await client.recv(timeout=60)
                            if isinstance(msg, Error):
                                answers[msg.code.value] += 1
                            else:
                                answers[msg.type] += 1
                            if msg == Pong(marker):
                                break
                    assert await client.ping("still here") == Pong("still here")
                except ConnectionLost as lost:
                    closes.append(lost.code)

    async def body() -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], Counter[str], list[int | None]]:
        answers: Counter[str] = Counter()
        closes: list[int | None] = []
        done = asyncio.Event()
        watcher = asyncio.create_task(bystander(done))
        try:
            await asyncio.gather(*(fuzz(i, answers, closes) for i in range(SOCKETS)))
        finally:
            done.set()
        disturbed = await watcher
        async with await RealtimeClient.connect(url, "msgpack") as client:  # the undisturbed reference
            await client.open(**CONFIG)
            reference = [
                (await client.turn(seq, tokens=c)).tokens
                for seq, c in enumerate(chunks[: len(disturbed)], start=1)
            ]
            await client.close()
        return disturbed, reference, answers, closes

    disturbed, reference, answers, closes = asyncio.run(asyncio.wait_for(body(), 300))
    print(f"answers to {FRAMES} malformed frames: {dict(answers)}; closes: {closes}")
    assert answers[ErrorCode.INTERNAL.value] == 0
    assert not [code for code in closes if code in (1006, 1011, None)]
    assert closes == []  # not one of them is fatal either
    assert answers[ErrorCode.INVALID_MESSAGE.value] > FRAMES // 2
    assert disturbed == reference and len(disturbed) >= 5
