"""The realtime workload one Locust user streams: what each chunk carries and which ones ask for a reply.

Defined once here so the locustfile's command-line defaults and the capacity benchmark's config
are the same numbers (docs/design.md section 9: 5 chunks/s of 16 tokens, an 8-token reply every 5th chunk).
No Locust or gevent import: the benchmark process imports this too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from shared.protocol.codec import Encoding

DEFAULT_CHUNK_MS: Final = 200.0
DEFAULT_CHUNK_TOKENS: Final = 16
DEFAULT_REPLY_EVERY: Final = 5
DEFAULT_REPLY_TOKENS: Final = 8
ENCODINGS: Final = {"json": Encoding.JSON, "msgpack": Encoding.MSGPACK}

# Request names in Locust's statistics: chunks that ask for no output, and chunks that ask for a reply.
CHUNK_NAME: Final = "chunk"
REPLY_NAME: Final = "reply"
# Failures that are not one chunk's: the session could not be opened or resumed, or it ended.
OPEN_NAME: Final = "session.open"
RESUME_NAME: Final = "session.resume"
SESSION_NAME: Final = "session"

# Token ids every preset has (tiny's vocabulary is 512) and that are no special token of SmolLM2's.
_TOKEN_BASE: Final = 100
_TOKEN_SPAN: Final = 256


@dataclass(frozen=True)
class ChunkLoad:
    chunk_ms: float = DEFAULT_CHUNK_MS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # Every `reply_every`-th chunk asks for `reply_tokens` outputs; 0 never asks.
    reply_every: int = DEFAULT_REPLY_EVERY
    reply_tokens: int = DEFAULT_REPLY_TOKENS
    encoding: str = "json"
    # When set, chunks carry pieces of this text (`chunk_tokens` words each) instead of token ids.
    text: str | None = None

    def __post_init__(self) -> None:
        if self.chunk_ms <= 0:
            raise ValueError(f"chunk_ms must be > 0, got {self.chunk_ms}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.reply_every < 0 or self.reply_tokens < 0:
            raise ValueError("reply_every and reply_tokens must be >= 0")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.text is not None and not self.text.split():
            raise ValueError("text must hold at least one word")

    @property
    def wire_encoding(self) -> Encoding:
        return ENCODINGS[self.encoding]

    @property
    def chunks_per_s(self) -> float:
        return 1000.0 / self.chunk_ms

    def reply_for(self, index: int) -> int:
        """Outputs the `index`-th chunk of a session (from 0) asks for."""
        if self.reply_every <= 0 or self.reply_tokens <= 0:
            return 0
        return self.reply_tokens if index % self.reply_every == self.reply_every - 1 else 0

    def name_for(self, index: int) -> str:
        return REPLY_NAME if self.reply_for(index) else CHUNK_NAME

    def tokens_for(self, index: int, salt: int) -> tuple[int, ...]:
        """Deterministic, varied token ids; `salt` keeps users from sending identical streams."""
        start = (index * self.chunk_tokens + salt * 7919) % _TOKEN_SPAN
        return tuple(_TOKEN_BASE + (start + i) % _TOKEN_SPAN for i in range(self.chunk_tokens))

    def text_for(self, index: int) -> str:
        """The next `chunk_tokens` words of the text, cycling, each followed by its space."""
        assert self.text is not None
        words = self.text.split()
        first = index * self.chunk_tokens
        return "".join(words[(first + i) % len(words)] + " " for i in range(self.chunk_tokens))
