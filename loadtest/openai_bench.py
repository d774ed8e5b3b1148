"""`python -m loadtest.openai_bench`: a 20-turn text conversation through the OpenAI dialect, with the
official SDK, against the same conversation re-sent whole each turn (what pipeline servers do).

One real stack of its own (embedded Valkey, one worker, one gateway; microturn/stack.py), auth off
on loopback. Two runs of the same conversation, one after the other:

- `session`: one `realtime.connect`; each turn sends its user item and `response.create`: the
  worker keeps the KV, so turn N prefills only its own new tokens;
- `resend`: each turn opens a new connection (a new session, nothing cached) and sends every item
  so far (the assistant items are the replies the `session` run generated, so both runs hold the
  same conversation), then `response.create`: turn N prefills the whole conversation.

Per turn: time to first text delta (from the turn's first send) and to `response.done`; the report
gives both per turn and the resend/session ratio of the time to first delta at the last turn. The
gateway gets generous chunk limits (a resent turn is dozens of items at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from microturn.processes import free_port
from microturn.stack import Stack, StackOptions

logger = logging.getLogger(__name__)

QUESTIONS = (
    "Hi! Can you help me plan a small vegetable garden?",
    "What should I plant first in spring?",
    "How much sun do tomatoes need?",
    "And how often should I water them?",
    "What about carrots, are they easy?",
    "Which soil is best for carrots?",
    "Can I grow lettuce next to them?",
    "How do I keep slugs away from lettuce?",
    "What is compost made of?",
    "How long does compost take to be ready?",
    "Should I use raised beds?",
    "How deep should a raised bed be?",
    "What wood is safe for a raised bed?",
    "Which herbs grow well with tomatoes?",
    "Does basil need a lot of water?",
    "When do I harvest basil?",
    "How do I store seeds for next year?",
    "What flowers attract bees to a garden?",
    "Is mulch worth it for a small garden?",
    "Thanks! Can you sum up my plan in one sentence?",
)
GATEWAY_ARGS = ("--max-chunks-per-s", "10000", "--chunk-burst", "10000", "--max-queued-tokens", "1000000")


@dataclass(frozen=True)
class Turn:
    turn: int
    ttft_ms: float
    done_ms: float
    input_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Report:
    model: str
    turns: int
    max_output_tokens: int
    session: list[Turn]
    resend: list[Turn]
    ttft_ratio_last: float
    ttft_ratio_last5_median: float


def _item(role: str, text: str) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


async def _answer(conn: Any, max_output_tokens: int, started: float) -> tuple[Turn, str]:
    await conn.response.create(response={"max_output_tokens": max_output_tokens})
    first: float | None = None
    while True:
        event = await conn.recv()
        if event.type == "error":
            raise RuntimeError(f"error event: {event.error.message}")
        if event.type == "response.output_text.delta" and first is None:
            first = time.perf_counter()
        if event.type == "response.done":
            done = time.perf_counter()
            usage = event.response.usage
            text = "".join(part.text or "" for item in event.response.output for part in item.content)
            ttft = (first if first is not None else done) - started
            turn = Turn(
                0,
                ttft * 1000,
                (done - started) * 1000,
                usage.input_tokens,
                usage.input_token_details.cached_tokens,
                usage.output_tokens,
            )
            return turn, text


async def _session_run(
    client: AsyncOpenAI, model: str, turns: int, max_out: int
) -> tuple[list[Turn], list[str]]:
    out, replies = [], []
    async with client.realtime.connect(model=model) as conn:
        assert (await conn.recv()).type == "session.created"
        for index in range(turns):
            started = time.perf_counter()
            await conn.conversation.item.create(item=_item("user", QUESTIONS[index]))  # type: ignore[arg-type]
            turn, reply = await _answer(conn, max_out, started)
            out.append(Turn(index + 1, *list(asdict(turn).values())[1:]))
            replies.append(reply)
            logger.warning("session turn %d: ttft %.0f ms", index + 1, turn.ttft_ms)
    return out, replies


async def _resend_run(client: AsyncOpenAI, model: str, replies: list[str], max_out: int) -> list[Turn]:
    out = []
    for index in range(len(replies)):
        async with client.realtime.connect(model=model) as conn:
            assert (await conn.recv()).type == "session.created"
            started = time.perf_counter()
            for earlier in range(index):
                await conn.conversation.item.create(item=_item("user", QUESTIONS[earlier]))  # type: ignore[arg-type]
                await conn.conversation.item.create(item=_item("assistant", replies[earlier]))  # type: ignore[arg-type]
            await conn.conversation.item.create(item=_item("user", QUESTIONS[index]))  # type: ignore[arg-type]
            turn, _ = await _answer(conn, max_out, started)
            out.append(Turn(index + 1, *list(asdict(turn).values())[1:]))
            logger.warning("resend turn %d: ttft %.0f ms", index + 1, turn.ttft_ms)
    return out


async def measure(base_url: str, model: str, turns: int, max_out: int) -> Report:
    client = AsyncOpenAI(base_url=base_url, api_key="unused-auth-off")
    session, replies = await _session_run(client, model, turns, max_out)
    resend = await _resend_run(client, model, replies, max_out)
    last5 = [r.ttft_ms / s.ttft_ms for s, r in zip(session[-5:], resend[-5:], strict=True)]
    return Report(
        model,
        turns,
        max_out,
        session,
        resend,
        resend[-1].ttft_ms / session[-1].ttft_ms,
        statistics.median(last5),
    )


def _table(report: Report) -> str:
    lines = ["turn | session ttft ms | resend ttft ms | ratio | session input (cached) | resend input"]
    for s, r in zip(report.session, report.resend, strict=True):
        lines.append(
            f"{s.turn:4d} | {s.ttft_ms:15.0f} | {r.ttft_ms:14.0f} | {r.ttft_ms / s.ttft_ms:5.1f} | "
            f"{s.input_tokens:6d} ({s.cached_tokens:5d}) | {r.input_tokens:6d}"
        )
    lines.append(
        f"ratio at turn {report.turns}: {report.ttft_ratio_last:.1f}x; "
        f"median of the last 5 turns: {report.ttft_ratio_last5_median:.1f}x"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.openai_bench", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="preset the worker serves")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--turns", type=int, default=20, choices=range(1, len(QUESTIONS) + 1), metavar="N")
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="openai-bench-") as work:
        options = StackOptions(
            model=args.model,
            device=args.device,
            port=free_port(),
            worker_port=free_port(),
            kv_tokens=16384,
            auth="off",
            gateway_args=GATEWAY_ARGS,
            log_path=Path(work) / "stack.log",
        )
        stack = Stack(options)
        try:
            stack.start()
            base_url = f"http://127.0.0.1:{options.port}/v1"
            report = asyncio.run(measure(base_url, args.model, args.turns, args.max_output_tokens))
        finally:
            stack.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
