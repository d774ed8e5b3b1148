"""Frames of the gateway <-> worker link (docs/design.md section 4): msgpack maps with `op` and `sid`.

Why its own frames: one link carries many sessions, so every frame names its session (`sid`),
and the worker needs things a client never sends (the token log at `restore`) while the gateway
needs things a client never sees (the session length after a turn, `durable_seq`). A frame that
relays a client message carries that message itself (`LinkChunk.chunk`, `LinkDone.done`, ...),
not a copy of its fields: the gateway forwards what it decoded and relays what it gets, and a new
field of a client message travels the link with no edit here. Only link-only fields sit beside it.

The link is internal and authenticated, so it is decoded by the field-driven codec
(link_codec.py), not the client protocol's strict rules; but a version skew or a bug still
fails loudly and typed: every malformed frame raises `InvalidMessage`.

Ops: gateway -> worker `open`, `attach` (resume), `restore` (rebuild from the token log), `chunk`,
`cancel`, `rewind`, `detach` (the client went away; the session stays resumable and becomes the first to
lose its KV under memory pressure), `close`; worker -> gateway `opened` (the answer to `open`,
`attach` and `restore`), `delta`, `done`, `rewound` (the answer to `rewind` and to a `cancel`
that keeps k outputs), `error`, `closed`, `migrate` (the worker is draining:
restore the session elsewhere). An `error` with an empty `sid` concerns the link itself (e.g. a
malformed frame whose session is unknown).

Exactly-once turns across a worker loss (docs/failover.md): `done` and `opened` carry
`durable_seq`, the last seq whose turn the worker's token log has confirmed in Redis; the gateway
keeps every chunk after it (and the output it delivered, if any) and hands that tail to the
restoring worker in `restore.tail`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias

from shared.errors import MicroturnError
from shared.protocol.key_limits import AuthLimits
from shared.protocol.messages import (
    CloseReason,
    Error,
    InputChunk,
    OpenConfig,
    OutputDelta,
    OutputDone,
    SessionRewind,
    SessionRewound,
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
    # With auth on, the limits the session was opened under (the rest of its record; carried so the
    # worker can re-write the record whole).
    auth: AuthLimits | None = None


@dataclass(frozen=True, slots=True)
class LinkAttach:
    op: ClassVar[str] = "attach"
    sid: str
    # The last output seq the client saw (None: none): the worker replays the `done` frames after it.
    seen_seq: int | None = None


@dataclass(frozen=True, slots=True)
class UndurableTurn:
    """A chunk the worker had not confirmed durable, and the output the client already got for it.

    `output` None: no `done` reached the client; the restoring worker runs the chunk (exactly one
    `done` then reaches the client). Otherwise the worker appends the chunk and these tokens as
    history (forced, no new `done`).
    """

    chunk: InputChunk
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
    tail: tuple[UndurableTurn, ...] = ()
    auth: AuthLimits | None = None  # as in `open`


@dataclass(frozen=True, slots=True)
class LinkChunk:
    op: ClassVar[str] = "chunk"
    sid: str
    chunk: InputChunk


@dataclass(frozen=True, slots=True)
class LinkCancel:
    op: ClassVar[str] = "cancel"
    sid: str
    seq: int
    # `output.cancel`'s: set, the history keeps the turn's first k outputs and `rewound` answers.
    keep_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class LinkRewind:
    """The client's `session.rewind`; answered by `rewound` once the edit is in the token log."""

    op: ClassVar[str] = "rewind"
    sid: str
    rewind: SessionRewind


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
    finished_seq: int | None = None
    # The last seq whose turn the token log holds in Redis (None: none yet).
    durable_seq: int | None = None


@dataclass(frozen=True, slots=True)
class LinkDelta:
    op: ClassVar[str] = "delta"
    sid: str
    delta: OutputDelta


@dataclass(frozen=True, slots=True)
class LinkDone:
    op: ClassVar[str] = "done"
    sid: str
    # What the client gets, as it gets it.
    done: OutputDone
    # The session's sequence length once this turn is done.
    length: int
    # The last seq whose turn the token log holds in Redis (None: none yet); piggybacked here so
    # durability costs no frame of its own.
    durable_seq: int | None = None


@dataclass(frozen=True, slots=True)
class LinkRewound:
    """A rewind (or `output.cancel` with `keep_output_tokens`) is applied and durable: the token log
    in Redis holds it, so a restore continues from the edited history (docs/failover.md)."""

    op: ClassVar[str] = "rewound"
    sid: str
    rewound: SessionRewound
    # As in `done`: every turn up to it is durable too (the rewind is logged after them).
    durable_seq: int | None = None


@dataclass(frozen=True, slots=True)
class LinkError:
    """An error for the session `sid`; an empty `sid` concerns the link itself."""

    op: ClassVar[str] = "error"
    sid: str
    error: Error


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
    # The worker already holding a warm copy of the session (a make-before-break drain,
    # worker/server/handover.py): restore it there, where only the turns since the copy are
    # prefilled. None: wherever placement says.
    target: str | None = None


@dataclass(frozen=True, slots=True)
class LinkWarm:
    """From a draining worker to the worker it hands a session to (worker/server/handover.py):
    build a copy of the session from its token log now, in the background, while the old worker
    keeps serving it; answer `warmed` when the copy is current. The gateway's `restore` that
    follows takes the copy over."""

    op: ClassVar[str] = "warm"
    sid: str
    config: OpenConfig = field(default_factory=OpenConfig)


@dataclass(frozen=True, slots=True)
class LinkWarmed:
    """The copy of `sid` is current up to the log's `durable_seq` (`length` tokens, all with KV)."""

    op: ClassVar[str] = "warmed"
    sid: str
    length: int
    durable_seq: int | None = None


ToWorker: TypeAlias = (
    LinkOpen
    | LinkAttach
    | LinkRestore
    | LinkChunk
    | LinkCancel
    | LinkRewind
    | LinkDetach
    | LinkClose
    | LinkWarm
)
# `warmed` goes back to the draining worker that asked for the copy, which dials the link as a
# gateway does; a gateway never asks for one.
ToGateway: TypeAlias = (
    LinkOpened | LinkDelta | LinkDone | LinkRewound | LinkError | LinkClosed | LinkMigrate | LinkWarmed
)
LinkFrame: TypeAlias = ToWorker | ToGateway

# Every frame class by its op: the registry `decode_link` (link_codec.py) and the round-trip test walk.
FRAME_CLASSES: Final[dict[str, type[LinkFrame]]] = {
    cls.op: cls
    for cls in (
        LinkOpen,
        LinkAttach,
        LinkRestore,
        LinkChunk,
        LinkCancel,
        LinkRewind,
        LinkDetach,
        LinkClose,
        LinkOpened,
        LinkDelta,
        LinkDone,
        LinkRewound,
        LinkError,
        LinkClosed,
        LinkMigrate,
        LinkWarm,
        LinkWarmed,
    )
}


def link_error_from(
    sid: str, exc: MicroturnError, seq: int | None = None, *, fatal: bool | None = None
) -> LinkError:
    """The `error` frame for a typed exception raised on the worker (`fatal` as in close_codes)."""
    fatal = not exc.recoverable if fatal is None else fatal
    return LinkError(sid, Error(exc.code, exc.message, fatal, seq, exc.retry_after_ms))
