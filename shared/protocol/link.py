"""Frames of the gateway <-> worker link (docs/design.md section 4): msgpack maps with `op` and `sid`.

Why its own vocabulary: one link carries many sessions, so every frame names its session (`sid`),
and the worker needs things a client never sends (the config at `open`, the token log at
`restore`) while the gateway needs things a client never sees (the session length after a turn,
for the session hash). The fields otherwise mirror the client messages so the gateway's hot path
is a field-for-field copy (see the `*_to_client` helpers).

The link is internal, but a version skew or a bug must fail loudly and typed, not corrupt a
session: decoding is as strict as the client codec's, and every failure raises `InvalidMessage`.

Ops: gateway -> worker `open`, `attach` (resume), `restore` (rebuild from the token log), `chunk`,
`cancel`, `detach` (the client went away; the session stays resumable and becomes the first to
lose its KV under memory pressure), `close`; worker -> gateway `opened` (the answer to `open`,
`attach` and `restore`), `delta`, `done`, `error`, `closed`, `migrate` (the worker is draining:
restore the session elsewhere). An `error` with an empty `sid` concerns the link itself (e.g. a
malformed frame whose session is unknown).

Exactly-once turns across a worker loss (docs/failover.md): `done` and `opened` carry
`durable_seq`, the last seq whose turn the worker's token log has confirmed in Redis; the gateway
keeps every chunk after it (and the output it delivered, if any) and hands that tail to the
restoring worker in `restore.tail`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias, cast

import msgpack

from shared.errors import ErrorCode, InvalidMessage, MicroturnError
from shared.protocol.codec import config_from_reader, fields_to_map, parse_msgpack
from shared.protocol.fields import MAX_TOKEN_ID, FieldReader
from shared.protocol.messages import (
    CLOSE_REASONS,
    FINISH_REASONS,
    CloseReason,
    Error,
    FinishReason,
    InputChunk,
    OpenConfig,
    OutputDelta,
    OutputDone,
    Timing,
)

# Where a worker serves the link, and the handshake header that carries `MT_LINK_SECRET`.
LINK_PATH: Final = "/v1/link"
LINK_SECRET_HEADER: Final = "x-microturn-link-secret"


# ---- gateway -> worker --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkOpen:
    op: ClassVar[str] = "open"
    sid: str
    config: OpenConfig = field(default_factory=OpenConfig)
    # Tokens the session starts with (a prompt); empty for a fresh session.
    history: tuple[int, ...] = ()
    # What the worker needs to re-write the session's record should Redis lose it (docs/failover.md):
    # the resume token's SHA-256 (never the token) and the creation time.
    token_sha256: str | None = None
    created_ms: int | None = None


@dataclass(frozen=True, slots=True)
class LinkAttach:
    op: ClassVar[str] = "attach"
    sid: str
    # The last output seq the client saw (None: none): the worker replays the `done` frames after it.
    seen_seq: int | None = None


@dataclass(frozen=True, slots=True)
class TailTurn:
    """A chunk the worker had not confirmed durable, and the output the client already got for it.

    `output` None: no `done` reached the client; the restoring worker runs the chunk (exactly one
    `done` then reaches the client). Otherwise the worker appends the chunk and these tokens as
    history (forced, no new `done`).
    """

    chunk: LinkChunk
    output: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class LinkRestore:
    op: ClassVar[str] = "restore"
    sid: str
    config: OpenConfig
    # The session's token log; None lets the worker read it from Redis itself.
    tokens: tuple[int, ...] | None = None
    # The last output seq the client saw (None: none), as in `attach`: if this worker still holds the
    # session it replays the `done` frames after it; a rebuilt session never accepts a seq at or below
    # it again (a turn the client saw is finished, whether or not the log holds it).
    seen_seq: int | None = None
    token_sha256: str | None = None  # as in `open`
    created_ms: int | None = None
    # The gateway's undurable tail, in seq order; turns the log already holds are skipped.
    tail: tuple[TailTurn, ...] = ()


@dataclass(frozen=True, slots=True)
class LinkChunk:
    op: ClassVar[str] = "chunk"
    sid: str
    seq: int
    tokens: tuple[int, ...] | None = None
    text: str | None = None
    max_output_tokens: int | None = None
    logprobs: bool | None = None
    flush: bool | None = None


@dataclass(frozen=True, slots=True)
class LinkCancel:
    op: ClassVar[str] = "cancel"
    sid: str
    seq: int


@dataclass(frozen=True, slots=True)
class LinkDetach:
    op: ClassVar[str] = "detach"
    sid: str


@dataclass(frozen=True, slots=True)
class LinkClose:
    op: ClassVar[str] = "close"
    sid: str
    reason: CloseReason = "closed"


# ---- worker -> gateway --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkOpened:
    op: ClassVar[str] = "opened"
    sid: str
    length: int
    # The last seq the session finished (None: none yet); chunks at or below it are refused.
    last_seq: int | None = None
    # The last seq whose turn the token log holds in Redis (None: none yet).
    durable_seq: int | None = None


@dataclass(frozen=True, slots=True)
class LinkDelta:
    op: ClassVar[str] = "delta"
    sid: str
    seq: int
    index: int
    token: int
    text: str | None = None
    logprob: float | None = None


@dataclass(frozen=True, slots=True)
class LinkDone:
    op: ClassVar[str] = "done"
    sid: str
    seq: int
    tokens: tuple[int, ...]
    text: str | None
    finish: FinishReason
    queue_ms: float
    compute_ms: float
    # The session's sequence length once this turn is done.
    length: int
    logprobs: tuple[float, ...] | None = None
    # As the client's `output.done.committed_tokens`.
    committed_tokens: int | None = None
    # The last seq whose turn the token log holds in Redis (None: none yet); piggybacked here so
    # durability costs no frame of its own.
    durable_seq: int | None = None


@dataclass(frozen=True, slots=True)
class LinkError:
    op: ClassVar[str] = "error"
    sid: str
    code: ErrorCode
    message: str
    fatal: bool
    seq: int | None = None
    retry_after_ms: int | None = None


@dataclass(frozen=True, slots=True)
class LinkClosed:
    op: ClassVar[str] = "closed"
    sid: str
    reason: CloseReason


@dataclass(frozen=True, slots=True)
class LinkMigrate:
    """The worker is draining: its log of this session is durable up to `durable_seq`; restore the
    session on another worker (a planned restore). The worker sends nothing more for it."""

    op: ClassVar[str] = "migrate"
    sid: str
    durable_seq: int | None = None


ToWorker: TypeAlias = LinkOpen | LinkAttach | LinkRestore | LinkChunk | LinkCancel | LinkDetach | LinkClose
ToGateway: TypeAlias = LinkOpened | LinkDelta | LinkDone | LinkError | LinkClosed | LinkMigrate
LinkFrame: TypeAlias = ToWorker | ToGateway


# ---- codec --------------------------------------------------------------------------------------


def _turn_to_map(turn: TailTurn) -> dict[str, object]:
    out = fields_to_map(turn.chunk, {})
    del out["sid"]  # the restore frame's
    if turn.output is not None:
        out["output"] = turn.output
    return out


def encode_link(frame: LinkFrame) -> bytes:
    """One binary link frame; `None` fields (and an empty restore tail) are left out."""
    out = fields_to_map(frame, {"op": frame.op})
    if isinstance(frame, LinkRestore):
        if frame.tail:
            out["tail"] = [_turn_to_map(turn) for turn in frame.tail]
        else:
            del out["tail"]
    packed: bytes = msgpack.packb(out, use_bin_type=True)
    return packed


def _sid(r: FieldReader) -> str:
    return r.string("sid", nonempty=True)


def _config(r: FieldReader) -> OpenConfig:
    sub = r.submap("config", required=False)
    return OpenConfig() if sub is None else config_from_reader(sub)


def _chunk(r: FieldReader, sid: str | None = None) -> LinkChunk:
    sid = _sid(r) if sid is None else sid
    seq, tokens, text = r.integer("seq"), r.token_ids("tokens"), r.opt_string("text")
    if (tokens is None) == (text is None):
        raise InvalidMessage("link chunk: exactly one of 'tokens' or 'text' is required")
    return LinkChunk(
        sid,
        seq,
        tokens,
        text,
        r.opt_integer("max_output_tokens"),
        r.opt_boolean("logprobs"),
        r.opt_boolean("flush"),
    )


def _done(r: FieldReader) -> LinkDone:
    sid, seq, tokens, text = _sid(r), r.integer("seq"), r.integers("tokens"), r.opt_string("text")
    finish = cast(FinishReason, r.choice("finish", FINISH_REASONS))
    queue_ms, compute_ms, length = r.number("queue_ms"), r.number("compute_ms"), r.integer("length")
    logprobs = r.opt_numbers("logprobs")
    if logprobs is not None and len(logprobs) != len(tokens):
        raise InvalidMessage(f"link done: {len(logprobs)} logprobs for {len(tokens)} tokens")
    committed, durable_seq = r.opt_integer("committed_tokens"), r.opt_integer("durable_seq")
    return LinkDone(
        sid, seq, tokens, text, finish, queue_ms, compute_ms, length, logprobs, committed, durable_seq
    )


def _tail(r: FieldReader, sid: str) -> tuple[TailTurn, ...]:
    raw = r.raw("tail")
    if raw is None:
        return ()
    if type(raw) is not list:
        raise InvalidMessage("link restore: field 'tail' must be a list")
    turns: list[TailTurn] = []
    for i, item in enumerate(raw):
        t = FieldReader(item, f"link restore tail[{i}]")
        chunk, output = _chunk(t, sid), t.opt_integers("output")
        t.done()
        if turns and chunk.seq <= turns[-1].chunk.seq:
            raise InvalidMessage("link restore: tail seqs must increase")
        turns.append(TailTurn(chunk, output))
    return tuple(turns)


def _restore(r: FieldReader) -> LinkRestore:
    sid, config, tokens, seen_seq = _sid(r), _config(r), r.opt_integers("tokens"), r.opt_integer("seen_seq")
    token_sha256, created_ms = r.opt_string("token_sha256"), r.opt_integer("created_ms")
    return LinkRestore(sid, config, tokens, seen_seq, token_sha256, created_ms, _tail(r, sid))


_DECODERS: dict[str, Callable[[FieldReader], LinkFrame]] = {
    LinkOpen.op: lambda r: LinkOpen(
        _sid(r),
        _config(r),
        r.opt_integers("history") or (),
        r.opt_string("token_sha256"),
        r.opt_integer("created_ms"),
    ),
    LinkAttach.op: lambda r: LinkAttach(_sid(r), r.opt_integer("seen_seq")),
    LinkRestore.op: _restore,
    LinkChunk.op: _chunk,
    LinkCancel.op: lambda r: LinkCancel(_sid(r), r.integer("seq")),
    LinkDetach.op: lambda r: LinkDetach(_sid(r)),
    LinkClose.op: lambda r: LinkClose(
        _sid(r), cast(CloseReason, r.opt_choice("reason", CLOSE_REASONS) or "closed")
    ),
    LinkOpened.op: lambda r: LinkOpened(
        _sid(r), r.integer("length"), r.opt_integer("last_seq"), r.opt_integer("durable_seq")
    ),
    LinkDelta.op: lambda r: LinkDelta(
        _sid(r),
        r.integer("seq"),
        r.integer("index"),
        r.integer("token", 0, MAX_TOKEN_ID),
        r.opt_string("text"),
        r.opt_number("logprob", float("-inf")),
    ),
    LinkDone.op: _done,
    LinkError.op: lambda r: LinkError(
        r.string("sid"),
        r.error_code("code"),
        r.string("message"),
        r.boolean("fatal"),
        r.opt_integer("seq"),
        r.opt_integer("retry_after_ms"),
    ),
    LinkClosed.op: lambda r: LinkClosed(_sid(r), cast(CloseReason, r.choice("reason", CLOSE_REASONS))),
    LinkMigrate.op: lambda r: LinkMigrate(_sid(r), r.opt_integer("durable_seq")),
}


def decode_link(data: bytes | bytearray | memoryview | str) -> LinkFrame:
    """Parse and validate one link frame (either direction); raises `InvalidMessage`."""
    if isinstance(data, str):
        raise InvalidMessage("text frame on the worker link: frames are binary msgpack")
    obj = parse_msgpack(data)
    op = FieldReader(obj, "link frame").raw("op")
    if type(op) is not str:
        raise InvalidMessage("a link frame needs a string field 'op'")
    decode = _DECODERS.get(op)
    if decode is None:
        raise InvalidMessage(f"unknown link op {op[:40]!r}")
    r = FieldReader(obj, f"link {op}", seen=("op",), checked=True)
    frame = decode(r)
    r.done()
    return frame


# ---- translation to and from the client protocol ------------------------------------------------


def chunk_to_link(sid: str, chunk: InputChunk) -> LinkChunk:
    return LinkChunk(
        sid, chunk.seq, chunk.tokens, chunk.text, chunk.max_output_tokens, chunk.logprobs, chunk.flush
    )


def delta_to_client(frame: LinkDelta) -> OutputDelta:
    return OutputDelta(frame.seq, frame.index, frame.token, frame.text, frame.logprob)


def done_to_client(frame: LinkDone) -> OutputDone:
    timing = Timing(frame.queue_ms, frame.compute_ms)
    return OutputDone(
        frame.seq, frame.tokens, frame.text, frame.finish, timing, frame.logprobs, frame.committed_tokens
    )


def error_to_client(frame: LinkError) -> Error:
    return Error(frame.code, frame.message, frame.fatal, frame.seq, frame.retry_after_ms)


def link_error_from(
    sid: str, exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None
) -> LinkError:
    """The `error` frame for a typed exception raised on the worker (`fatal` as in close_codes)."""
    fatal = not exc.recoverable if fatal is None else fatal
    return LinkError(sid, exc.code, exc.message, fatal, seq, exc.retry_after_ms)
