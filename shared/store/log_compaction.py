"""Compaction of a session's token log: what a restore needs, in bytes bounded by the window.

A log grows by one record per turn for as long as the session lives, but a restore needs only
(shared/store/log_format.py `decode_log`): the history as it stands (cuts applied), the seq it ends at,
the text tail after it, and the records of the last few turns, whose spans answer a turn the
gateway still holds undelivered (worker/server/restore.py). So a compacted log is

    SNAPSHOT directive + one record: the history as of the record before the last `keep_records`
    (its seq and text tail), then those last records verbatim, directives and all

which decodes to the same tokens, seq, tail and spans of its last records as the log it replaces.
Its size is bounded by the session's window plus `keep_records` records, however long the session
ran. The worker compacts its logs when it flushes them (worker/server/token_log.py).
"""

from __future__ import annotations

from shared.store.log_format import (
    DIRECTIVE_SNAPSHOT,
    NO_SEQ,
    Cut,
    decode_log,
    encode_directive,
    encode_log_record,
    log_entries,
)


def records_since_snapshot(data: bytes) -> int:
    """How many records the log holds after its last snapshot (all of them when it has none)."""
    count = 0
    for entry in log_entries(data):
        count = 0 if _is_snapshot(entry.directive) else count + 1
    return count


def compact_log(data: bytes, keep_records: int) -> bytes:
    """The log with everything before its last `keep_records` records folded into one snapshot;
    `data` itself when there is nothing before them to fold. ValueError if it is corrupt.

    Duplicates (retried appends) among the kept records stay: they decode as skipped, as before."""
    if keep_records < 0:
        raise ValueError(f"keep_records must be >= 0, got {keep_records}")
    entries = list(log_entries(data))
    folded = len(entries) - keep_records
    if folded <= 0 or (folded == 1 and _is_snapshot(entries[0].directive)):
        return data
    split = entries[folded].start if folded < len(entries) else len(data)
    state = decode_log(data[:split])
    snapshot = encode_log_record(
        NO_SEQ if state.durable_seq is None else state.durable_seq,
        state.tokens,
        tail_text=state.tail_text,
        tail_context=state.tail_context,
    )
    return encode_directive(DIRECTIVE_SNAPSHOT) + snapshot + data[split:]


def _is_snapshot(directive: tuple[int, Cut] | None) -> bool:
    return directive is not None and directive[0] == DIRECTIVE_SNAPSHOT
