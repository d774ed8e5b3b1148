"""The token log's byte format (`mt:log:{<sid>}`, docs/design.md section 5), and `Cut`, the window
cut its directives record.

The token log is a plain STRING grown with APPEND once per turn (O(1) amortised, no
read-modify-write), and replaced whole by its compacted form once per many turns
(shared/store/log_compaction.py). It is a run of *records*, one per logged turn:

    header (24 bytes): n_tokens <u4 | seq <i8 | n_inputs <u4 | tail_bytes <u4 | context_bytes <u4
    body:              n_tokens token ids (<u4 each: the turn's inputs, then its outputs),
                       then tail_bytes of UTF-8 tail text, then context_bytes of UTF-8 context

so the log can say which turn it ends at (`LogState.durable_seq`): a restoring worker replays from the
gateway's undurable tail only the turns after it (docs/failover.md). `n_inputs` says where the
turn's committed input ends and its output begins (a text chunk's input tokens cannot be recomputed
from its text alone). The tail text and context are the session's uncommitted text right after the
turn's input was committed (worker/tokenizer/incremental.py `TextTail`): a restored session starts
from the tail of the log's last record, so text held back at the durable point is not lost. Every
length is in the header, so the log decodes in one pass. `seq` -1 marks tokens that
belong to no turn (a prompt given at open): only a log's first record (or a snapshot) may be one,
so a later copy is a retried append and is skipped. A record whose seq is not above the last one already
read is a duplicate (an append retried after a connection broke mid-pipeline, or a worker the
gateways had given up on flushing late) and is skipped: appends are idempotent per turn.

A *directive* (16 bytes) may stand before a record and says what happens to the history before
that record's tokens are added; it is skipped with its record when the record is a duplicate:

    0xFFFFFFFF <u4 | kind <u4 | keep <u4 | recent <u4

- `CUT` (1): the session's window was cut before this turn (worker/engine/memory/window.py): the
  history becomes its first `keep` tokens followed by its last `recent`. A restore rebuilds the
  window the session had, not one of its own.
- `SNAPSHOT` (2): the record holds the whole history as of its seq (the log was compacted to it,
  worker/server/token_log.py); it is no turn of its own, so it has no span to answer from.
- `REWIND` (3): the session was rewound (a client took its history back, worker/engine/rewind.py):
  the history becomes its first `keep` tokens (`recent` is 0). Its record is no turn: it holds no
  tokens, the session's text tail after the rewind (none: a rewind ends on a token boundary), and
  the seq of the last record before it (`NO_SEQ` when none), which is how a reader tells the
  rewind from a retried copy of it: it applies only right where it was written, after that seq.
  Applying it twice in a row changes nothing.

The marker cannot start a plain record (its token count would be 2**32 - 1), so logs written
before directives existed read the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from shared.protocol.fields import MAX_TOKEN_ID

TOKEN_BYTES: Final = 4
NO_SEQ: Final = -1  # the seq of a log record that belongs to no turn
_LOG_DTYPE: Final = np.dtype("<u4")  # explicit byte order: the log must read the same on any host
_RECORD_HEADER: Final = np.dtype(
    [("n", "<u4"), ("seq", "<i8"), ("inputs", "<u4"), ("tail", "<u4"), ("context", "<u4")]
)
RECORD_HEADER_BYTES: Final = _RECORD_HEADER.itemsize  # 24
DIRECTIVE_MARKER: Final = 0xFFFFFFFF
_DIRECTIVE: Final = np.dtype([("marker", "<u4"), ("kind", "<u4"), ("keep", "<u4"), ("recent", "<u4")])
DIRECTIVE_BYTES: Final = _DIRECTIVE.itemsize  # 16
DIRECTIVE_CUT: Final = 1
DIRECTIVE_SNAPSHOT: Final = 2
DIRECTIVE_REWIND: Final = 3
_DIRECTIVE_KINDS: Final = (DIRECTIVE_CUT, DIRECTIVE_SNAPSHOT, DIRECTIVE_REWIND)


@dataclass(frozen=True, slots=True)
class Cut:
    """A window cut: the history becomes its first `keep` tokens followed by its last `recent`.

    The engine's window rule decides each cut (worker/engine/memory/window.py); it is defined here,
    with the log that records it as a `CUT` directive and applies it when read, since a restore
    (and a compaction) must rebuild the same window and shared/ imports nothing of the worker."""

    keep: int
    recent: int

    def apply(self, tokens: list[int]) -> list[int]:
        recent = tokens[len(tokens) - self.recent :] if self.recent > 0 else []
        return tokens[: self.keep] + recent


def encode_tokens(tokens: list[int]) -> bytes:
    """Token ids -> the log's byte layout (little-endian uint32), refusing ids that would wrap."""
    if not tokens:
        return b""
    # int64 first so negatives and ids >= 2**32 are caught here instead of silently wrapping.
    try:
        wide = np.asarray(tokens, dtype=np.int64)
    except OverflowError as exc:
        raise ValueError("token id out of uint32 range") from exc
    if wide.ndim != 1:
        raise ValueError("tokens must be a flat list of ints")
    if int(wide.min()) < 0 or int(wide.max()) > MAX_TOKEN_ID:
        raise ValueError(f"token id out of uint32 range [0, {MAX_TOKEN_ID}]")
    return wide.astype(_LOG_DTYPE).tobytes()


def decode_tokens(data: bytes) -> list[int]:
    """The log's bytes -> token ids; a length that is not a multiple of 4 means a corrupt log."""
    if len(data) % TOKEN_BYTES:
        raise ValueError(f"token log length {len(data)} is not a multiple of {TOKEN_BYTES}")
    values: list[int] = np.frombuffer(data, dtype=_LOG_DTYPE).tolist()
    return values


@dataclass(frozen=True, slots=True)
class LogState:
    """A decoded token log: the session's tokens, the seq of the last turn it holds, and the
    session's uncommitted text (`tail_text`, `tail_context`) as of that turn.

    `spans` maps the seq of each record after `decode_log`'s `spans_after` to its tokens' slice in
    `tokens`: (start, end of the inputs, end). A restoring worker reads the output of a turn whose
    answer was lost.
    """

    tokens: list[int]
    durable_seq: int | None
    spans: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    tail_text: str = ""
    tail_context: str = ""
    # The text tail (text, context) each record with a span left held back, when not empty: what
    # a rewind to that turn restores (worker/engine/turn_ends.py).
    span_tails: dict[int, tuple[str, str]] = field(default_factory=dict)


def encode_log_record(
    seq: int,
    tokens: list[int] | tuple[int, ...],
    *,
    inputs: int | None = None,
    tail_text: str = "",
    tail_context: str = "",
) -> bytes:
    """One turn's record in the log's byte layout. `inputs`: how many of `tokens` are the turn's
    input (default all of them); `tail_text`/`tail_context`: the session's text tail after it."""
    if seq < NO_SEQ:
        raise ValueError(f"seq must be >= {NO_SEQ}, got {seq}")
    n_inputs = len(tokens) if inputs is None else inputs
    if not 0 <= n_inputs <= len(tokens):
        raise ValueError(f"inputs must be within 0..{len(tokens)}, got {n_inputs}")
    text, context = tail_text.encode(), tail_context.encode()
    header = np.zeros(1, dtype=_RECORD_HEADER)
    header["n"] = len(tokens)
    header["seq"] = seq
    header["inputs"] = n_inputs
    header["tail"] = len(text)
    header["context"] = len(context)
    return header.tobytes() + encode_tokens(list(tokens)) + text + context


def _spans_after_cut(
    spans: dict[int, tuple[int, int, int]], length: int, cut: Cut
) -> dict[int, tuple[int, int, int]]:
    """The spans of turns that lie wholly in the recent tokens a cut keeps, moved to where they are
    now; a turn the cut reached can no longer be answered from the log."""
    first_kept = length - cut.recent
    shift = cut.keep - first_kept
    return {
        seq: (start + shift, inputs_end + shift, end + shift)
        for seq, (start, inputs_end, end) in spans.items()
        if cut.recent > 0 and start >= first_kept
    }


def encode_directive(kind: int, cut: Cut = Cut(0, 0)) -> bytes:
    """A directive (`DIRECTIVE_CUT` with its cut, `DIRECTIVE_SNAPSHOT`, or `DIRECTIVE_REWIND` with
    `Cut(length, 0)`) for the record after it."""
    if kind not in _DIRECTIVE_KINDS or cut.keep < 0 or cut.recent < 0:
        raise ValueError(f"bad directive {kind} {cut}")
    directive = np.zeros(1, dtype=_DIRECTIVE)
    directive["marker"] = DIRECTIVE_MARKER
    directive["kind"] = kind
    directive["keep"] = cut.keep
    directive["recent"] = cut.recent
    return directive.tobytes()


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One record of a log as stored, with the directive before it (if any): where its bytes lie.

    `start` is where the entry begins (its directive, or its header when it has none) and `end`
    where the next begins, so `data[entry.start:]` is a log of its own from that record on."""

    start: int
    end: int
    seq: int
    inputs: int
    tokens_at: int  # where its token ids begin; its tail text follows them at `text_at`
    text_at: int
    context_at: int
    directive: tuple[int, Cut] | None = None


def log_entries(data: bytes) -> Iterator[LogEntry]:
    """The log's records in stored order, duplicates included; ValueError if it is corrupt.

    One step per record (its header has every length), never per token."""
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        start, directive = offset, None
        if _directive_at(view, offset):
            if len(view) - offset < DIRECTIVE_BYTES:
                raise ValueError(f"token log has a truncated directive at byte {offset}")
            fields = np.frombuffer(view[offset : offset + DIRECTIVE_BYTES], dtype=_DIRECTIVE)[0]
            kind = int(fields["kind"])
            if kind not in _DIRECTIVE_KINDS:
                raise ValueError(f"token log has an unknown directive {kind} at byte {offset}")
            directive = (kind, Cut(int(fields["keep"]), int(fields["recent"])))
            offset += DIRECTIVE_BYTES
            if offset == len(view):
                raise ValueError("token log ends in a directive with no record after it")
            if _directive_at(view, offset):
                raise ValueError(f"token log has a misplaced directive at byte {offset}")
        if len(view) - offset < RECORD_HEADER_BYTES:
            raise ValueError(f"token log truncated in a record header at byte {offset}")
        header = np.frombuffer(view[offset : offset + RECORD_HEADER_BYTES], dtype=_RECORD_HEADER)[0]
        n, n_inputs = int(header["n"]), int(header["inputs"])
        tokens_at = offset + RECORD_HEADER_BYTES
        text_at = tokens_at + n * TOKEN_BYTES
        context_at = text_at + int(header["tail"])
        end = context_at + int(header["context"])
        if end > len(view) or n_inputs > n:
            raise ValueError(f"token log truncated or corrupt in the record at byte {offset}")
        yield LogEntry(start, end, int(header["seq"]), n_inputs, tokens_at, text_at, context_at, directive)
        offset = end


def _directive_at(view: memoryview, offset: int) -> bool:
    return len(view) - offset >= 4 and int.from_bytes(view[offset : offset + 4], "little") == DIRECTIVE_MARKER


def decode_log(data: bytes, spans_after: int | None = None) -> LogState:
    """The log's bytes -> its tokens, last seq and text tail, skipping duplicate records;
    ValueError if corrupt. Runs only on restore (and on a compaction, log_compaction.py)."""
    view = memoryview(data)
    tokens: list[int] = []
    durable_seq: int | None = None
    spans: dict[int, tuple[int, int, int]] = {}
    tail = ("", "")
    span_tails: dict[int, tuple[str, str]] = {}
    read_any = False
    for entry in log_entries(data):
        seq = entry.seq
        if entry.directive is not None and entry.directive[0] == DIRECTIVE_REWIND:
            if seq != (NO_SEQ if durable_seq is None else durable_seq):
                continue  # a retried copy, after later turns: the rewind was applied where it stood
            keep = entry.directive[1].keep
            tokens = tokens[:keep]
            # A turn it cut inside its outputs ends where the rewind did; a later one is gone.
            spans = {s: (a, b, min(c, keep)) for s, (a, b, c) in spans.items() if b <= keep}
            tail = _tail_of(view, entry)
            read_any = True
            continue
        if seq != NO_SEQ and durable_seq is not None and seq <= durable_seq:
            continue  # a duplicate of a turn already read, with its directive
        snapshot = entry.directive is not None and entry.directive[0] == DIRECTIVE_SNAPSHOT
        if seq == NO_SEQ and read_any and not snapshot:
            continue  # tokens of no turn open a log: after another record, a retried append's copy
        read_any = True
        if entry.directive is not None:
            kind, cut = entry.directive
            if kind == DIRECTIVE_SNAPSHOT:
                tokens, spans = [], {}
            else:
                spans = _spans_after_cut(spans, len(tokens), cut)
                tokens = cut.apply(tokens)
        start = len(tokens)
        tokens.extend(decode_tokens(bytes(view[entry.tokens_at : entry.text_at])))
        tail = _tail_of(view, entry)
        if seq != NO_SEQ:
            durable_seq = seq
            is_turn = entry.directive is None or entry.directive[0] != DIRECTIVE_SNAPSHOT
            if is_turn and spans_after is not None and seq > spans_after:
                spans[seq] = (start, start + entry.inputs, len(tokens))
                if tail != ("", ""):
                    span_tails[seq] = tail
    kept_tails = {seq: held for seq, held in span_tails.items() if seq in spans}
    return LogState(tokens, durable_seq, spans, *tail, span_tails=kept_tails)


def _tail_of(view: memoryview, entry: LogEntry) -> tuple[str, str]:
    """The record's text tail and its context."""
    try:
        text = str(view[entry.text_at : entry.context_at], "utf-8")
        return text, str(view[entry.context_at : entry.end], "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"token log has bad text in the record at byte {entry.start}") from exc
