"""Which link each session answers to, and what a session's binding remembers between frames.

Binding invariant: a session is bound to at most one link, the last one that opened, attached or
restored it. Its outputs go there and nowhere else; with no link bound (the client went away)
outputs are kept only in the replay buffer, for an `attach` to send again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from shared.protocol.key_limits import AuthLimits
from shared.protocol.link import LinkDone, ToGateway
from shared.protocol.messages import InputChunk, OpenConfig
from worker.server.restore import REPLAY_DONES, RestorePlan


class LinkPeer(Protocol):
    """The sending half of one gateway's link; `send` never blocks."""

    def send(self, frame: ToGateway) -> None: ...


@dataclass(eq=False)
class SessionBinding:
    sid: str
    stream: bool
    idle_timeout_s: float
    link: LinkPeer | None
    length: int = 0
    # The last seq the session finished here (None: none yet), as `opened` reports it.
    finished_seq: int | None = None
    # False while the session is being opened or rebuilt; chunks that arrive meanwhile wait here.
    ready: bool = False
    waiting: list[InputChunk] = field(default_factory=list)
    replay: deque[LinkDone] = field(default_factory=lambda: deque(maxlen=REPLAY_DONES))
    # What the session record holds, so this worker can re-write it after Redis lost its data.
    config: OpenConfig = field(default_factory=OpenConfig)
    token_sha256: str | None = None
    created_ms: int = 0
    auth: AuthLimits | None = None
    # Set while a restore opens the session: what `opened` still has to log, answer and run.
    restore: RestorePlan | None = None
    # Set while a fresh session opens with `keep_prefix_text`: its tokens, logged once it is open.
    prefix: list[int] = field(default_factory=list)
    # Chunks submitted to the engine and not answered yet: a switch waits for none (switchover.py).
    in_flight: int = 0
    # Chunks answered here (a drain reports how many it served while the session's copy warmed).
    turns_answered: int = 0

    def send(self, frame: ToGateway) -> None:
        if self.link is not None:
            self.link.send(frame)

    def record(self, done: LinkDone) -> None:
        self.replay.append(done)
        self.length = done.length
        self.finished_seq = done.done.seq

    def missed(self, seen_seq: int | None) -> list[LinkDone]:
        """The dones after the last one the client saw, as far as the replay buffer reaches."""
        return [d for d in self.replay if seen_seq is None or d.done.seq > seen_seq]


class SessionDirectory:
    def __init__(self) -> None:
        self.bindings: dict[str, SessionBinding] = {}
        # Sessions with traffic since the last heartbeat: their Redis TTLs get refreshed then.
        self.touched: set[str] = set()

    def get(self, sid: str) -> SessionBinding | None:
        return self.bindings.get(sid)

    def add(self, binding: SessionBinding) -> None:
        self.bindings[binding.sid] = binding
        self.touched.add(binding.sid)

    def remove(self, sid: str) -> SessionBinding | None:
        self.touched.discard(sid)
        return self.bindings.pop(sid, None)

    def unbind_link(self, link: LinkPeer) -> int:
        count = 0
        for binding in self.bindings.values():
            if binding.link is link:
                binding.link = None
                count += 1
        return count

    def take_touched(self) -> dict[str, float]:
        """The touched sessions and their idle timeouts, clearing the set."""
        touched = {sid: self.bindings[sid].idle_timeout_s for sid in self.touched if sid in self.bindings}
        self.touched.clear()
        return touched
