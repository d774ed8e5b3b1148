"""The host side of the compose smoke (scripts/compose_smoke.py): sessions through the gateway,
and what the engine alone answers to the same input.

The Python client sends token chunks; the engine alone, fed the same chunks in one session, must
give the same tokens. The OpenAI SDK holds a two-turn conversation; the engine alone, fed the whole
conversation rendered by the model's chat template (tests/system/gateway/openai_reference.py, the
reference the OpenAI tests use), must give the same texts.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TURNS = ["What is the capital of France?", "And of Italy?"]
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
REPLY_TOKENS = 16
REFERENCE_MODEL = "smollm2-135m"  # the model tests/system/gateway/openai_reference.py loads
logger = logging.getLogger("compose-smoke")


async def client_session(url: str, key: str, chunks: list[list[int]]) -> list[list[int]]:
    from shared.client import RealtimeClient

    outputs = []
    async with await RealtimeClient.connect(url, api_key=key) as client:
        opened = await client.open(max_output_tokens=REPLY_TOKENS, stop_token_ids=[])
        for seq, chunk in enumerate(chunks, start=1):
            outputs.append(list((await client.turn(seq=seq, tokens=chunk, timeout=120)).tokens))
        await client.close()
    logger.info("Python client: session %s, %d turns", opened.session_id, len(outputs))
    return outputs


def engine_outputs(model: str, chunks: list[list[int]]) -> list[list[int]]:
    from worker.engine import Engine

    with Engine.load(model, kv_tokens=8192) as engine:
        sid = engine.open_session(max_output_tokens=REPLY_TOKENS, stop_token_ids=())
        turns = [
            engine.run_turn(sid, tokens=chunk, seq=seq, timeout=300) for seq, chunk in enumerate(chunks, 1)
        ]
        return [list(turn.tokens) for turn in turns]


async def openai_session(base_url: str, key: str, model: str) -> list[str]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=key)
    texts = []
    async with client.realtime.connect(model=model) as conn:
        assert (await conn.recv()).type == "session.created"
        session = {"type": "realtime", "instructions": INSTRUCTIONS, "output_modalities": ["text"]}
        await conn.session.update(session=session)  # type: ignore[arg-type]
        for text in TURNS:
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            await conn.conversation.item.create(item=item)  # type: ignore[arg-type]
            await conn.response.create(response={"max_output_tokens": REPLY_TOKENS})
            while (event := await conn.recv()).type != "response.done":
                assert event.type != "error", f"OpenAI session: {event}"
                if event.type == "response.output_text.done":
                    texts.append(event.text)
    return texts


def openai_reference(model: str) -> subprocess.Popen[str]:
    """Started first, it runs while the stack starts; `openai_expected` reads its answer."""
    plan = {"instructions": INSTRUCTIONS, "turns": TURNS, "max_output_tokens": REPLY_TOKENS}
    assert model == REFERENCE_MODEL, f"the OpenAI reference is {REFERENCE_MODEL}'s, the worker serves {model}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.system.gateway.openai_reference"],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(plan))
    proc.stdin.close()
    return proc


def openai_expected(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    texts = json.loads(proc.stdout.read())["texts"]
    assert proc.wait(600) == 0, "the OpenAI reference failed"
    return texts  # type: ignore[no-any-return]
