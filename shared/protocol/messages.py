"""The messages of client protocol v1 (docs/design.md section 3) as plain frozen dataclasses.

Why a separate module: the gateway, the Python client, the tests and the load generator all build
and inspect these messages, while only the codec knows how they look on the wire. Keeping them
inert (no I/O, no validation, no encoding) lets every layer share one typed vocabulary; the codec
is the single place that checks what arrives from outside.

Each message class has a `type` class attribute with its wire name. Optional fields are `None`
when absent; the codec leaves them out on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeAlias, get_args

from shared.errors import ErrorCode, MicroturnError, error_from_code
from shared.protocol.response_format import ResponseFormat

ContextPolicy = Literal["error", "truncate"]
FinishReason = Literal["length", "stop", "cancelled"]
CloseReason = Literal["idle_timeout", "evicted", "closed", "taken_over", "worker_lost"]
# Why a session will end with `session_expired` (the limits of its API key or browser token).
ExpiryReason = Literal["max_duration", "token_budget"]

CONTEXT_POLICIES: tuple[str, ...] = get_args(ContextPolicy)
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
CLOSE_REASONS: tuple[str, ...] = get_args(CloseReason)
EXPIRY_REASONS: tuple[str, ...] = get_args(ExpiryReason)


@dataclass(frozen=True, slots=True)
class OpenConfig:
    """The `config` of `session.open`; every field has the protocol's default."""

    # Output tokens sampled after each chunk unless the chunk says otherwise.
    max_output_tokens: int = 0
    # 0 means greedy.
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    # None stops at the model's EOS tokens; an explicit tuple (possibly empty) replaces them.
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: bool = False
    idle_timeout_s: float | None = None
    max_context_tokens: int | None = None
    context_policy: ContextPolicy = "error"
    # With `truncate`: how many of the first tokens (a system prompt) always stay in the window.
    keep_prefix_tokens: int = 0
    # With `truncate`: a cut keeps the window to this share of `max_context_tokens`, so the next cut
    # is far off (worker/engine/memory/window.py has the rule); 1.0 cuts to exactly the limit.
    retention_ratio: float = 0.8
    # With `truncate`: text the session starts with (a system prompt), kept across every cut. The
    # worker commits it whole at open; its tokens are the kept prefix (`keep_prefix_tokens` stays 0).
    keep_prefix_text: str | None = None
    # Per-token `output.delta` messages before each `output.done`.
    stream: bool = False
    # Only workers serving this model (their registered name) may hold the session; None: any.
    model: str | None = None
    # The default shape of every turn's output (a turn's own `response_format` replaces it).
    response_format: ResponseFormat | None = None


# ---- client -> server -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionOpen:
    type: ClassVar[str] = "session.open"
    config: OpenConfig = field(default_factory=OpenConfig)


@dataclass(frozen=True, slots=True)
class SessionResume:
    type: ClassVar[str] = "session.resume"
    session_id: str
    resume_token: str
    # The last output `seq` the client saw; None when it saw none.
    last_seq: int | None = None


@dataclass(frozen=True, slots=True)
class InputChunk:
    """Exactly one of `tokens` or `text` is set (the codec enforces it on decode)."""

    type: ClassVar[str] = "input.chunk"
    seq: int
    tokens: tuple[int, ...] | None = None
    text: str | None = None
    max_output_tokens: int | None = None
    logprobs: bool | None = None
    # Commit the session's held-back text now (as asking for output or a token chunk does), so the
    # next text starts a new segment; see "Text input is exact" in docs/protocol.md.
    flush: bool | None = None
    # Constrain this turn's output (shared/protocol/response_format.py); None: the session's default.
    response_format: ResponseFormat | None = None


@dataclass(frozen=True, slots=True)
class OutputCancel:
    type: ClassVar[str] = "output.cancel"
    seq: int
    # The history keeps only this turn's first k outputs (the ones the client delivered), also for
    # the session's last turn once it finished; answered by `session.rewound` too. None: the turn
    # stops and keeps what it produced (no rewind).
    keep_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SessionRewind:
    """Take the session's history back; exactly one of `to_seq` and `keep_tokens` is set (the codec
    enforces it). Its running and queued turns are cancelled first. Answered by `session.rewound`."""

    type: ClassVar[str] = "session.rewind"
    # The history becomes what it was right after this turn's `output.done`, its outputs included.
    to_seq: int | None = None
    # The history becomes its first N tokens.
    keep_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SessionClose:
    type: ClassVar[str] = "session.close"


@dataclass(frozen=True, slots=True)
class Ping:
    type: ClassVar[str] = "ping"
    # Any JSON / msgpack value; echoed back unchanged in `pong`.
    data: object = None


ClientMessage: TypeAlias = (
    SessionOpen | SessionResume | InputChunk | OutputCancel | SessionRewind | SessionClose | Ping
)


# ---- server -> client -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionOpened:
    type: ClassVar[str] = "session.opened"
    session_id: str
    resume_token: str
    model: str
    # Limits that apply to this session (frame bytes, tokens per chunk, ...): name -> number.
    limits: dict[str, int | float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SessionResumed:
    type: ClassVar[str] = "session.resumed"
    session_id: str
    # Tokens in the session's sequence.
    length: int
    # The last `seq` the server finished; None when no chunk has run yet.
    last_seq: int | None = None


@dataclass(frozen=True, slots=True)
class SessionRestored:
    """Unsolicited: the session moved to another worker and its KV was rebuilt from the log."""

    type: ClassVar[str] = "session.restored"
    session_id: str
    length: int


@dataclass(frozen=True, slots=True)
class SessionRewound:
    """The answer to `session.rewind` and to `output.cancel` with `keep_output_tokens`: the history
    now has `length` tokens (durable: a restore continues from it); the next chunk appends after."""

    type: ClassVar[str] = "session.rewound"
    length: int


@dataclass(frozen=True, slots=True)
class OutputDelta:
    type: ClassVar[str] = "output.delta"
    seq: int
    # Position of this token among the turn's outputs, from 0.
    index: int
    token: int
    # The token's text; None when the model has no tokenizer.
    text: str | None = None
    logprob: float | None = None


@dataclass(frozen=True, slots=True)
class Timing:
    queue_ms: float
    compute_ms: float


@dataclass(frozen=True, slots=True)
class OutputDone:
    type: ClassVar[str] = "output.done"
    seq: int
    tokens: tuple[int, ...]
    # None when the model has no tokenizer.
    text: str | None
    finish: FinishReason
    timing: Timing
    # One per token when the chunk (or the session) asked for logprobs.
    logprobs: tuple[float, ...] | None = None
    # Input tokens this chunk appended to the session's sequence. A text chunk commits only the
    # tokens no later text can change (plus earlier held-back text it completes); the rest waits
    # for the next chunk, a flush, or a chunk asking for output. None from servers that predate it.
    committed_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SessionExpiring:
    """Unsolicited warning: the session is about to reach a limit of its credential and will then
    end with a fatal `session_expired` error (close code 4010)."""

    type: ClassVar[str] = "session.expiring"
    session_id: str
    reason: ExpiryReason
    # `max_duration`: milliseconds until the session ends.
    expires_in_ms: int | None = None
    # `token_budget`: tokens (in + out) the session may still spend.
    tokens_left: int | None = None


@dataclass(frozen=True, slots=True)
class SessionClosed:
    type: ClassVar[str] = "session.closed"
    reason: CloseReason


@dataclass(frozen=True, slots=True)
class Error:
    type: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    # A fatal error is followed by a close of the socket with the matching 4xxx code.
    fatal: bool
    seq: int | None = None
    retry_after_ms: int | None = None

    def to_exception(self) -> MicroturnError:
        """The typed exception this error stands for (what the Python client raises)."""
        return error_from_code(self.code, self.message, retry_after_ms=self.retry_after_ms)


@dataclass(frozen=True, slots=True)
class Pong:
    type: ClassVar[str] = "pong"
    data: object = None


ServerMessage: TypeAlias = (
    SessionOpened
    | SessionResumed
    | SessionRestored
    | SessionExpiring
    | SessionRewound
    | OutputDelta
    | OutputDone
    | SessionClosed
    | Error
    | Pong
)
