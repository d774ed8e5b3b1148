"""The small conversions every Redis record needs, defined once: the clock, replies as text, digests."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping


def now_ms() -> int:
    """Wall-clock milliseconds, as record timestamps (`created_ms`, expiries) store them."""
    return time.time_ns() // 1_000_000


def text(value: bytes | str) -> str:
    """A reply element as text: bytes with the default client, str with decode_responses=True."""
    return value.decode() if isinstance(value, bytes) else value


def text_map(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A hash reply (HGETALL) as str -> str."""
    return {text(k): text(v) for k, v in raw.items()}


def sha256_hex(secret: str) -> str:
    """The only form a secret is stored in (resume tokens, API keys, browser tokens). Unsalted is
    enough: each is 256 random bits, not a password."""
    return hashlib.sha256(secret.encode()).hexdigest()
