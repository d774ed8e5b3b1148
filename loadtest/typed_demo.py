"""`python -m loadtest.typed_demo`: the demo page's typed micro-turns, timed as a browser sends them.

Issue #32, point 5: "The demo page's typed micro-turns, timed as a browser sends them, reported at
p50 and p99 before and after." One real stack per weight form (embedded Valkey, one worker with
`--weights FORM`, one gateway; microturn/stack.py), and one session driven exactly as
gateway/static/index.html drives it:

- the page's constants and its `session.open` config are read from the page itself (`PageScript`),
  so the bench cannot drift from what a browser sends;
- `Composer` is the page's `commitTyped`/`takePiece`/`tick`/`sendMessage`/`onDone` without a
  browser: every TICK_MS the words finished since the last tick (up to the last whitespace after
  a word; a message's first piece opens the user turn), pieces of at most MAX_PIECE_CHARS, the
  last piece plus the assistant's opening asking for the reply, no chunk while a reply runs, and
  the glue that closes the assistant turn once the reply is done;
- a typist at `--wpm` presses keys on a fixed seeded schedule, aligned to the page's ticks, so
  every run (and every weight form) sends the same chunks; the chunks still go out in real time.

Measured: each input micro-turn from its send to its `output.done` (the latency the page shows on
its chip), and each reply's first token, its `output.done` and its tokens per second. `--compare
float,auto` runs the forms one after the other in one invocation (`float` is the page before #32,
`auto` after it: the GGUF served as int4) and prints them side by side. The report names the
machine and its load, and says when other processes competed for the CPU (loadtest/bench/host.py).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import logging
import os
import platform
import random
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final, Literal, get_args

import numpy as np

from loadtest.bench.host import HostProbe
from loadtest.bench.report import OTHER_CPU_WARN_SHARE
from loadtest.report_files import write_json
from microturn.processes import free_port
from microturn.stack import Stack, StackOptions
from shared.client import NO_RETRY, RealtimeClient
from shared.protocol.messages import Error, OutputDelta, OutputDone, SessionClosed
from shared.settings import WEIGHT_FORMS

logger = logging.getLogger(__name__)

# A conversation a demo visitor might type: 2-4 sentences a message, each turn following the reply.
MESSAGES: Final = (
    "Hi! I'm planning a weekend in Lisbon with two friends. We like good food, old neighbourhoods "
    "and a bit of walking. What should we not miss?",
    "That sounds great, thanks. Is it easy to get from the airport to the city centre by public "
    "transport? We land late on Friday evening.",
    "One of us is vegetarian. Could you suggest a few Portuguese dishes she could try, or places "
    "that are good for that?",
    "Last question: what is a good day trip from Lisbon if the weather is nice on Sunday? We would "
    "rather avoid very crowded places.",
)
# Characters a word is taken to have when typing speed is given in words a minute.
CHARS_PER_WORD: Final = 5
# Each key's interval is the mean interval times a factor drawn uniformly from this range.
KEY_JITTER: Final = (0.5, 1.5)
# How long the bench waits for one reply (or for the last chunks) before it gives up.
ANSWER_TIMEOUT_S: Final = 600.0

ChunkKind = Literal["system", "input", "reply", "glue"]


# ---- the page -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PageScript:
    """The demo page's constants and `session.open` config, as its script defines them."""

    system: str
    user_open: str
    assistant_open: str
    end: str
    tick_ms: int
    reply_tokens: int
    max_piece_chars: int
    open_config: dict[str, Any]

    @classmethod
    def read(cls) -> PageScript:
        """Parsed from gateway/static/index.html; a change of its shape fails here, loudly."""
        page = resources.files("gateway").joinpath("static", "index.html").read_text(encoding="utf-8")

        def const(name: str) -> Any:
            found = re.search(rf"const {name} = (.+?);", page)
            if found is None:
                raise ValueError(f"the demo page no longer defines {name}")
            return json.loads(found.group(1))  # the page's literals are JSON (strings, integers)

        config = re.search(r'type: "session\.open",\s*config: \{(.*?)\}', page, re.DOTALL)
        if config is None:
            raise ValueError("the demo page no longer sends a session.open config")
        fields = re.findall(r'(\w+): ("[^"]*"|true|false|[0-9.]+)', config.group(1))
        return cls(
            system=const("SYSTEM"),
            user_open=const("USER_OPEN"),
            assistant_open=const("ASSISTANT_OPEN"),
            end=const("END"),
            tick_ms=const("TICK_MS"),
            reply_tokens=const("REPLY_TOKENS"),
            max_piece_chars=const("MAX_PIECE_CHARS"),
            open_config={name: json.loads(value) for name, value in fields},
        )


@dataclass(frozen=True)
class Chunk:
    """One `input.chunk` the page sends."""

    kind: ChunkKind
    text: str
    max_output_tokens: int


class Composer:
    """The page's typing -> micro-turns logic (index.html, "typing -> micro-turns" and `onDone`),
    line for line, with the text box's value passed in. Invariant: the pieces of one message, put
    together, are the message with its surrounding whitespace stripped."""

    def __init__(self, page: PageScript, reply_tokens: int) -> None:
        self.page = page
        self.reply_tokens = reply_tokens
        self.streamed_len = 0  # characters at the start of the text box already committed
        self.outbox = ""  # committed text not yet sent
        self.user_open = False  # the user turn's opening already sent for this message
        self.want_reply = False  # the message was sent: ask for the reply once the outbox is empty
        self.reply_running = False  # a reply is generating: the page sends nothing meanwhile

    def _commit_typed(self, value: str, everything: bool) -> None:
        end = len(value)
        if not everything:
            end = -1
            for i in range(len(value) - 1, self.streamed_len, -1):
                if value[i].isspace() and not value[i - 1].isspace():
                    end = i
                    break
            if end <= self.streamed_len:
                return
        piece = value[self.streamed_len : end]
        if not self.user_open and not self.outbox:
            piece = re.sub(r"^\s+", "", piece)
        if everything:
            piece = re.sub(r"\s+\Z", "", piece)
        self.outbox += piece
        self.streamed_len = end

    def _take_piece(self) -> str:
        limit = self.page.max_piece_chars
        if len(self.outbox) <= limit:
            piece, self.outbox = self.outbox, ""
            return piece
        cut = self.outbox.rfind(" ", 0, limit + 1)  # JS lastIndexOf(" ", limit)
        if cut <= 0:
            cut = limit
        piece, self.outbox = self.outbox[:cut], self.outbox[cut:]
        return piece

    def tick(self, value: str) -> Chunk | None:
        """The page's `tick()`, with the text box holding `value`: the chunk it sends, if any."""
        if self.reply_running:
            return None
        if not self.want_reply:
            self._commit_typed(value, False)
        if not self.outbox and not self.want_reply:
            return None
        prefix = "" if self.user_open else self.page.user_open
        self.user_open = True
        piece = self._take_piece()
        if self.want_reply and not self.outbox:
            self.want_reply = False
            self.user_open = False
            self.reply_running = True
            return Chunk("reply", prefix + piece + self.page.assistant_open, self.reply_tokens)
        return Chunk("input", prefix + piece, 0)

    def send_message(self, value: str) -> Chunk | None:
        """The page's `sendMessage()` (Enter): commit everything, then tick with the box emptied."""
        if self.reply_running or self.want_reply or not value.strip():
            return None
        self._commit_typed(value, True)
        self.streamed_len = 0
        self.want_reply = True
        return self.tick("")

    def reply_done(self, closed_by_model: bool) -> Chunk:
        """The page's `onDone` of the reply (or `onError`: not closed by the model): the glue that
        closes the assistant turn, so the chat template holds."""
        self.reply_running = False
        return Chunk("glue", "\n" if closed_by_model else self.page.end + "\n", 0)


# ---- the typist -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedChunk:
    """A chunk and when the page sends it, in seconds from the tick the message's typing began."""

    at_s: float
    chunk: Chunk


def keystrokes(text: str, wpm: float, seed: int) -> tuple[list[float], float]:
    """When each character of `text` is typed and when Enter is pressed (seconds from the start):
    a fixed schedule for a seed, at `wpm` words a minute on average."""
    rng = random.Random(seed)
    mean_s = 60.0 / (wpm * CHARS_PER_WORD)
    times: list[float] = []
    now = 0.0
    for _ in text:
        now += mean_s * rng.uniform(*KEY_JITTER)
        times.append(now)
    return times, now + mean_s * rng.uniform(*KEY_JITTER)


def plan_message(composer: Composer, text: str, wpm: float, seed: int) -> list[TimedChunk]:
    """The chunks the page sends while `text` is typed and sent, up to and including the one
    asking for the reply. Typing starts on a tick; the page ticks every TICK_MS after it."""
    typed_at, enter_at = keystrokes(text, wpm, seed)
    tick_s = composer.page.tick_ms / 1000
    plan: list[TimedChunk] = []
    entered = False
    tick = 1
    while not composer.reply_running:
        at = tick * tick_s
        if not entered and enter_at < at:
            entered = True
            chunk = composer.send_message(text)
            at = enter_at
        else:
            # After Enter the text box is empty (and the page commits nothing while a reply waits).
            chunk = composer.tick("" if entered else text[: bisect.bisect_right(typed_at, at)])
            tick += 1
        if chunk is not None:
            plan.append(TimedChunk(at, chunk))
    return plan


def script(messages: int, words: int | None) -> tuple[str, ...]:
    """The first `messages` of MESSAGES, each cut to its first `words` words (None: whole)."""
    if not 1 <= messages <= len(MESSAGES):
        raise ValueError(f"--messages must be 1 to {len(MESSAGES)}")
    if words is not None and words < 1:
        raise ValueError("--words must be at least 1")
    chosen = MESSAGES[:messages]
    return chosen if words is None else tuple(" ".join(m.split()[:words]) for m in chosen)


# ---- one session through a real stack -------------------------------------------------------------


@dataclass
class Sent:
    """One chunk as sent and answered (monotonic seconds)."""

    kind: ChunkKind
    chars: int
    sent_s: float
    first_token_s: float | None = None
    done_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Options:
    """What the bench types and where: the model, the typist's speed and seed, the script's size."""

    model: str = "smollm2-135m"
    wpm: float = 60.0
    messages: int = len(MESSAGES)
    words: int | None = None
    # None: the page's REPLY_TOKENS.
    reply_tokens: int | None = None
    seed: int = 0


class PageSession:
    """One browser tab: the page's socket, its composer, and what each chunk took."""

    def __init__(self, client: RealtimeClient, page: PageScript, reply_tokens: int) -> None:
        self.client = client
        self.composer = Composer(page, reply_tokens)
        self.sent: dict[int, Sent] = {}
        self.seq = 0
        self.reply_answered = asyncio.Event()
        self.closed_by_model = False
        self.end = page.end

    async def send(self, chunk: Chunk) -> None:
        self.seq += 1
        self.sent[self.seq] = Sent(chunk.kind, len(chunk.text), time.monotonic())
        await self.client.send_chunk(self.seq, text=chunk.text, max_output_tokens=chunk.max_output_tokens)

    async def receive(self) -> None:
        """The page's `onMessage`: timestamps every answer; a reply's answer wakes the typist."""
        while True:
            msg = await self.client.recv(timeout=None)
            now = time.monotonic()
            if isinstance(msg, OutputDelta):
                entry = self.sent.get(msg.seq)
                if entry is not None and entry.first_token_s is None:
                    entry.first_token_s = now
            elif (isinstance(msg, Error) and msg.fatal) or isinstance(msg, SessionClosed):
                raise RuntimeError(f"the session ended: {msg}")
            elif isinstance(msg, OutputDone | Error) and msg.seq in self.sent:
                entry = self.sent[msg.seq]
                closed_by_model = False
                if isinstance(msg, OutputDone):
                    entry.done_s, entry.output_tokens = now, len(msg.tokens)
                    closed_by_model = msg.finish == "stop" and (msg.text or "").endswith(self.end)
                else:
                    entry.error = msg.code
                if entry.kind == "reply":
                    # The page closes the assistant turn itself unless the model did (with END).
                    self.closed_by_model = closed_by_model
                    self.reply_answered.set()

    @property
    def unanswered(self) -> int:
        return sum(1 for s in self.sent.values() if s.done_s is None and s.error is None)


async def _sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


async def _converse(session: PageSession, messages: Sequence[str], options: Options) -> None:
    tick_s = session.composer.page.tick_ms / 1000
    ticks_from = time.monotonic()  # the page's interval, running since the session opened
    await session.send(Chunk("system", session.composer.page.system, 0))
    for index, text in enumerate(messages):
        # The typist starts on the tick after the previous reply (and its glue): the same schedule
        # against the page's ticks in every run, whatever the replies took.
        start = ticks_from + tick_s * (int((time.monotonic() - ticks_from) / tick_s) + 1)
        session.reply_answered.clear()
        for timed in plan_message(session.composer, text, options.wpm, options.seed * 1000 + index):
            await _sleep_until(start + timed.at_s)
            await session.send(timed.chunk)
        await asyncio.wait_for(session.reply_answered.wait(), ANSWER_TIMEOUT_S)
        await session.send(session.composer.reply_done(session.closed_by_model))
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while session.unanswered and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def run_page(url: str, page: PageScript, options: Options) -> list[Sent]:
    """One session typed and sent as the page does; every chunk's timings, in send order."""
    reply_tokens = page.reply_tokens if options.reply_tokens is None else options.reply_tokens
    # The page never resends a refused chunk: neither does the bench (a refusal is counted).
    client = await RealtimeClient.connect(url, retry=NO_RETRY)
    async with client:
        await client.open(**page.open_config)
        session = PageSession(client, page, reply_tokens)
        receiver = asyncio.create_task(session.receive())
        typist = asyncio.create_task(_converse(session, script(options.messages, options.words), options))
        done, _ = await asyncio.wait({receiver, typist}, return_when=asyncio.FIRST_COMPLETED)
        receiver.cancel()
        typist.cancel()
        for task in done:
            task.result()  # the receiver only ends by raising
        await asyncio.gather(receiver, typist, return_exceptions=True)
        await client.close()
    return [session.sent[seq] for seq in sorted(session.sent)]


# ---- figures --------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    array = np.asarray(values, dtype=np.float64)
    return {
        "count": len(values),
        "p50": round(float(np.percentile(array, 50)), 1),
        "p99": round(float(np.percentile(array, 99)), 1),
        "max": round(float(array.max()), 1),
    }


def figures(sent: Sequence[Sent]) -> dict[str, Any]:
    """Input micro-turns: send to `output.done`, ms. Replies: to the first token and to
    `output.done`, ms, and tokens per second after the first token (the decode rate)."""
    inputs: list[float] = []
    first: list[float] = []
    whole: list[float] = []
    rates: list[float] = []
    for s in sent:
        if s.done_s is None:
            continue
        if s.kind == "input":
            inputs.append((s.done_s - s.sent_s) * 1000)
        elif s.kind == "reply":
            whole.append((s.done_s - s.sent_s) * 1000)
            if s.first_token_s is not None:
                first.append((s.first_token_s - s.sent_s) * 1000)
                if s.output_tokens > 1 and s.done_s > s.first_token_s:
                    rates.append((s.output_tokens - 1) / (s.done_s - s.first_token_s))
    return {
        "chunks": {kind: sum(1 for s in sent if s.kind == kind) for kind in get_args(ChunkKind)},
        "input_chars": sum(s.chars for s in sent if s.kind == "input"),
        "errors": sorted(s.error for s in sent if s.error is not None),
        "unanswered": sum(1 for s in sent if s.done_s is None and s.error is None),
        "input_ms": _spread(inputs),
        "reply_first_token_ms": _spread(first),
        "reply_done_ms": _spread(whole),
        "reply_tokens_per_s": _spread(rates),
        "reply_output_tokens": [s.output_tokens for s in sent if s.kind == "reply" and s.done_s is not None],
    }


def machine() -> dict[str, Any]:
    """The CPU (its model name from /proc/cpuinfo where there is one) and its hardware threads."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        name = found.group(1).strip() if found else name
    return {"cpu": name, "threads": os.cpu_count() or 0, "platform": platform.platform()}


def run_form(weights: str, page: PageScript, options: Options, work: Path) -> dict[str, Any]:
    """One weight form on its own stack: the page's session through it, and the host meanwhile."""
    probe = HostProbe.start()
    stack = Stack(
        StackOptions(
            model=options.model,
            device="cpu",
            port=free_port(),
            worker_port=free_port(),
            worker_args=("--weights", weights),
            log_path=work / f"stack-{weights}.log",
        )
    )
    try:
        stack.start()
        url = stack.local_url.replace("http://", "ws://", 1) + "/v1/realtime"
        started = time.monotonic()
        sent = asyncio.run(run_page(url, page, options))
        session_s = time.monotonic() - started
    finally:
        stack.stop()
    # After the stop: the stack's processes are reaped, so their CPU counts as the bench's own.
    host = probe.finish()
    host["loadavg_1m_after"] = os.getloadavg()[0]
    host["quiet"] = host["other_cpu_share"] < OTHER_CPU_WARN_SHARE
    return {"weights": weights, "session_s": round(session_s, 1), **figures(sent), "host": host}


def run(forms: Sequence[str], options: Options) -> dict[str, Any]:
    page = PageScript.read()
    reply_tokens = page.reply_tokens if options.reply_tokens is None else options.reply_tokens
    with tempfile.TemporaryDirectory(prefix="typed-demo-") as work:
        runs = [run_form(form, page, options, Path(work)) for form in forms]
    return {
        "model": options.model,
        "wpm": options.wpm,
        "messages": options.messages,
        "words": options.words,
        "reply_tokens": reply_tokens,
        "seed": options.seed,
        "tick_ms": page.tick_ms,
        "machine": machine(),
        "runs": runs,
    }


def table(report: dict[str, Any]) -> str:
    """The runs side by side, one figure a row; the machine, its load, and whether it was quiet."""
    runs = report["runs"]

    def spread_rows(label: str, key: str, unit: str) -> list[tuple[str, list[str]]]:
        def cell(run: dict[str, Any], stat: str) -> str:
            value = run[key][stat]
            return "-" if value is None else f"{value:,.1f}"

        return [
            (f"{label} {stat} {unit}", [cell(run, stat) for run in runs]) for stat in ("p50", "p99", "max")
        ]

    rows: list[tuple[str, list[str]]] = [
        ("weights", [run["weights"] for run in runs]),
        ("input micro-turns (count)", [str(run["input_ms"]["count"]) for run in runs]),
        *spread_rows("input micro-turn", "input_ms", "ms"),
        ("replies (count)", [str(run["reply_done_ms"]["count"]) for run in runs]),
        *spread_rows("reply first token", "reply_first_token_ms", "ms"),
        *spread_rows("reply done", "reply_done_ms", "ms"),
        ("reply tokens/s p50", [_cell(run["reply_tokens_per_s"]["p50"]) for run in runs]),
        ("reply output tokens", [" ".join(map(str, run["reply_output_tokens"])) for run in runs]),
        ("errors, unanswered", [f"{len(run['errors'])}, {run['unanswered']}" for run in runs]),
        ("session s", [f"{run['session_s']:.1f}" for run in runs]),
        ("load average 1m before/after", [_load(run["host"]) for run in runs]),
        ("other processes' CPU share", [f"{run['host']['other_cpu_share']:.0%}" for run in runs]),
    ]
    width = max(len(name) for name, _ in rows)
    column = max(12, *(len(value) + 2 for _, values in rows for value in values))
    machine_ = report["machine"]
    lines = [
        f"the demo page's typed micro-turns: {report['model']}, {report['wpm']:g} wpm, "
        f"{report['messages']} messages, replies of up to {report['reply_tokens']} tokens, "
        f"a tick every {report['tick_ms']} ms",
        *(f"{name:<{width}}" + "".join(f"{value:>{column}}" for value in values) for name, values in rows),
        f"machine: {machine_['cpu']}, {machine_['threads']} threads",
    ]
    for run in runs:
        if not run["host"]["quiet"]:
            lines.append(
                f"{run['weights']}: timings are NOT from a quiet machine (other processes used "
                f"{run['host']['other_cpu_s']:.1f} CPU-s, {run['host']['other_cpu_share']:.0%} of one core)"
            )
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _load(host: dict[str, Any]) -> str:
    return f"{host['loadavg_1m_before']:.2f}/{host['loadavg_1m_after']:.2f}"


# ---- the command ----------------------------------------------------------------------------------


def _forms(text: str) -> tuple[str, ...]:
    forms = tuple(part for part in text.split(",") if part)
    unknown = [form for form in forms if form not in WEIGHT_FORMS]
    if unknown or not forms:
        raise argparse.ArgumentTypeError(f"weight forms are {', '.join(WEIGHT_FORMS)}; got {text!r}")
    return forms


def parse(argv: Sequence[str] | None) -> tuple[tuple[str, ...], Options, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m loadtest.typed_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=Options.model, help="the worker's model (default smollm2-135m)")
    parser.add_argument(
        "--weights", default="auto", choices=WEIGHT_FORMS, help="the worker's --weights: float = before #32"
    )
    parser.add_argument(
        "--compare", type=_forms, default=None, help="forms run one after the other, e.g. float,auto"
    )
    parser.add_argument("--wpm", type=float, default=Options.wpm, help="the typist's words a minute")
    parser.add_argument("--messages", type=int, default=Options.messages, help="conversation turns")
    parser.add_argument("--words", type=int, default=None, help="cut each message to its first N words")
    parser.add_argument("--reply-tokens", type=int, default=None, help="default: the page's REPLY_TOKENS")
    parser.add_argument("--seed", type=int, default=Options.seed, help="the typing schedule's seed")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if args.wpm <= 0:
        parser.error("--wpm must be positive")
    try:
        script(args.messages, args.words)
    except ValueError as exc:
        parser.error(str(exc))
    options = Options(args.model, args.wpm, args.messages, args.words, args.reply_tokens, args.seed)
    return args.compare or (args.weights,), options, args.json


def main(argv: Sequence[str] | None = None) -> int:
    forms, options, json_path = parse(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run(forms, options)
    if json_path is not None:
        write_json(report, json_path)
    sys.stdout.write(table(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
