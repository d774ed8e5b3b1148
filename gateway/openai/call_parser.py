"""A response's text as it streams, split into its visible text and its tool call (tools.py's format).

Why a streaming parser: text deltas go out as they come, and a call's arguments go out as
`response.function_call_arguments.delta` while they are generated. A piece that could still be the
start of `<tool_call>` (or of the call's end) is held back until the next text settles it, so text
never shows a piece of a call and the arguments never show a piece of its end.

After `<tool_call>` the text is exactly `CALL_PREFIX`, the name, `ARGUMENTS_PREFIX`, the
arguments and `CALL_END` when the grammar holds the response (tools.py `constraint`); text that
does not follow it (a response with no grammar) is read as text. The arguments end at the first
`CALL_END`: inside JSON a newline only appears escaped, so it cannot be part of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from gateway.openai.tools import ARGUMENTS_PREFIX, CALL_END, CALL_PREFIX, CALL_TRIGGER


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class CallStarted:
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallEnded:
    arguments: str
    complete: bool  # False: the response ended inside the call (its length, a cancel)


Piece: TypeAlias = Text | CallStarted | ArgumentsDelta | CallEnded


def _held(buffer: str, marker: str) -> int:
    """How many characters at the end of `buffer` could be the start of `marker`."""
    for size in range(min(len(buffer), len(marker) - 1), 0, -1):
        if marker.startswith(buffer[-size:]):
            return size
    return 0


class CallParser:
    def __init__(self) -> None:
        self._state: Literal["text", "head", "arguments", "after"] = "text"
        self._buffer = ""
        self._arguments: list[str] = []

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            progressed = self._step(pieces)
            if not progressed:
                return pieces

    def finish(self) -> list[Piece]:
        """The response ended: what was held back, and an unfinished call as incomplete."""
        buffer, self._buffer = self._buffer, ""
        if self._state == "arguments":
            self._state = "after"
            self._arguments.append(buffer)
            return (
                [ArgumentsDelta(buffer), CallEnded("".join(self._arguments), False)]
                if buffer
                else [CallEnded("".join(self._arguments), False)]
            )
        return [Text(buffer)] if buffer else []

    def _step(self, pieces: list[Piece]) -> bool:
        """One move of the state machine over the buffer; False when it must wait for more."""
        buffer = self._buffer
        if self._state in ("text", "after"):
            at = buffer.find(CALL_TRIGGER) if self._state == "text" else -1
            if at < 0:
                keep = _held(buffer, CALL_TRIGGER) if self._state == "text" else 0
                if len(buffer) > keep:
                    pieces.append(Text(buffer[: len(buffer) - keep]))
                    self._buffer = buffer[len(buffer) - keep :]
                return False
            if at:
                pieces.append(Text(buffer[:at]))
            self._buffer, self._state = buffer[at:], "head"
            return True
        if self._state == "head":
            if not (buffer.startswith(CALL_PREFIX) or CALL_PREFIX.startswith(buffer)):
                self._state = "after"  # not a call after all: text (no grammar held it)
                return True
            end = buffer.find(ARGUMENTS_PREFIX, len(CALL_PREFIX))
            if end < 0:
                return False
            pieces.append(CallStarted(buffer[len(CALL_PREFIX) : end]))
            self._buffer, self._state = buffer[end + len(ARGUMENTS_PREFIX) :], "arguments"
            return True
        # arguments
        at = buffer.find(CALL_END)
        if at >= 0:
            if at:
                pieces.append(ArgumentsDelta(buffer[:at]))
            self._arguments.append(buffer[:at])
            pieces.append(CallEnded("".join(self._arguments), True))
            self._buffer, self._state = buffer[at + len(CALL_END) :], "after"
            return True
        keep = _held(buffer, CALL_END)
        if len(buffer) > keep:
            pieces.append(ArgumentsDelta(buffer[: len(buffer) - keep]))
            self._arguments.append(buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
        return False
