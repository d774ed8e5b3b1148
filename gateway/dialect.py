"""A socket's dialect: how its frames become session requests and session messages become frames.

Why a seam here: the session (gateway/session/) speaks one language, microturn's native messages
(shared/protocol/messages.py). A client may speak another (the OpenAI Realtime events of #18); the
dialect, chosen once at the handshake, translates both ways and is the only per-socket code that
knows the wire shape. The native dialect is the identity over the codec: byte for byte what the
gateway sent before dialects existed.

Contract (Sans-I/O, as the codec): no I/O and no clock. `decode` turns one client frame into the
native requests to run, in order, and any frames the dialect answers itself (sent before the
requests run); it raises `MicroturnError` only for what the session should answer as a native error.
`encode` turns one session message into the frames to send (none, one or several), in order; it is
called by the socket's one writer, in the order the messages were queued. A dialect that holds
client requests back until a session message comes (the OpenAI dialect queues input behind a
running response) hands them over through `take_released` right after that message's `encode`;
the shell runs them at once, in order. `attach` gives the dialect the session's one admission rule
(gateway/limits.py `SessionLimits`), built once by the session machine, before any frame is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.limits import SessionLimits, check_frame_size
from gateway.metric_families import Metric
from gateway.metrics import GatewayMetrics
from shared.protocol.codec import Encoding, decode_client, encode_server
from shared.protocol.messages import ClientMessage, OutputDone, ServerMessage, SessionOpened

Frame = str | bytes


@dataclass(frozen=True, slots=True)
class Decoded:
    """What one client frame asks: native requests for the session, and the dialect's own replies."""

    messages: tuple[ClientMessage, ...] = ()
    replies: tuple[Frame, ...] = ()


class Dialect(Protocol):
    """One socket's translation; stateful dialects keep their state per socket."""

    @property
    def name(self) -> str:
        """The dialect's label on metrics (`dialect="native"`)."""
        ...

    @property
    def closes_on_disconnect(self) -> bool:
        """True when the session ends with the socket (no resume in the dialect); False: detach."""
        ...

    def greeting(self) -> Decoded:
        """What runs and is sent as the socket opens, before its first frame is read."""
        ...

    def attach(self, limits: SessionLimits) -> None:
        """The session's admission rule, for a dialect that admits whole events itself."""
        ...

    def decode(self, data: Frame) -> Decoded: ...

    def encode(self, message: ServerMessage) -> Sequence[Frame]: ...

    def take_released(self) -> tuple[ClientMessage, ...]:
        """Requests held back until the message just encoded; each is handed over once."""
        ...


def frame_size(data: Frame, limit: int) -> int:
    """The frame's size in bytes; a text frame is only encoded when its length could exceed `limit`."""
    if isinstance(data, bytes) or len(data) * 4 <= limit:  # UTF-8 is at most 4 bytes per character
        return len(data)
    return len(data.encode())


@dataclass(frozen=True, slots=True)
class NativeDialect:
    """microturn protocol v1 (docs/protocol.md) in JSON or msgpack."""

    encoding: Encoding
    max_frame_bytes: int
    # Counts sessions and turns under `dialect="native"`; None: not counted (tests, refusals).
    metrics: GatewayMetrics | None = None

    @property
    def name(self) -> str:
        return "native"

    @property
    def closes_on_disconnect(self) -> bool:
        return False  # a native session outlives its socket: `session.resume` takes it back

    def greeting(self) -> Decoded:
        return Decoded()

    def attach(self, limits: SessionLimits) -> None:
        pass  # each native chunk is admitted by the session machine itself

    def decode(self, data: Frame) -> Decoded:
        check_frame_size(frame_size(data, self.max_frame_bytes), self.max_frame_bytes)
        return Decoded((decode_client(data, self.encoding),))

    def take_released(self) -> tuple[ClientMessage, ...]:
        return ()  # a native client's chunks queue in the session (docs/protocol.md)

    def encode(self, message: ServerMessage) -> Sequence[Frame]:
        if self.metrics is not None:
            if isinstance(message, SessionOpened):
                self.metrics.count(Metric.DIALECT_SESSIONS, label=self.name)
            elif isinstance(message, OutputDone):
                self.metrics.count(Metric.DIALECT_TURNS, label=self.name)
        return (encode_server(message, self.encoding),)
