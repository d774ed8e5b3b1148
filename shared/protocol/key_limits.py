"""A key's limits, one dataclass wherever they go: the key's record, a browser token, a session's grant.

Each limit is one field of `KeyLimits` (0: no limit), and every place that holds limits walks the
fields, so a new limit is a field here plus its enforcement (gateway/auth/session_auth.py):
- an API key's record stores and reads them back by name, and `microturn keys create` has a flag
  for each (gateway/auth/api_keys.py, keys.py);
- a browser token holds the *granted* ones (metadata `granted`: what each session gets, not what
  the key shares among them), each never above its key's (`capped_by`), and `token_only` ones that
  only a token sets (gateway/auth/client_tokens.py);
- a session lives under the granted ones it was opened with, and whose key they came from
  (`AuthLimits`): part of its record, written and read by name (shared/store/registry.py), and
  carried to its worker on the link, so a resume through any gateway applies the same ones.

The limits a key shares among its sessions (concurrent sessions, the daily budget) and its chunk
rate are read from the key itself at each open and resume, never carried.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A key's limits, one field per limit, 0: none (the module's docstring says where each
    goes). Metadata: `help` (the `microturn keys` flag's), `granted` (per session: a browser token
    narrows it, a session keeps it), `token_only` (only a browser token sets it)."""

    max_sessions: int = field(default=0, metadata={"help": "concurrent sessions"})
    chunks_per_s: float = field(default=0.0, metadata={"help": "chunks per second per session"})
    max_session_s: float = field(
        default=0.0, metadata={"help": "longest session in seconds", "granted": True}
    )
    max_tokens_per_day: int = field(default=0, metadata={"help": "tokens in + out per UTC day"})
    max_tokens: int = field(
        default=0, metadata={"help": "tokens in + out per session", "granted": True, "token_only": True}
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(KeyLimits):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0 (0: no limit)")

    @staticmethod
    def names(*, granted: bool = False, key: bool = False) -> tuple[str, ...]:
        """The limits' names: every one, or only the `granted` ones, or only those a `key` sets."""
        return tuple(
            f.name
            for f in dataclasses.fields(KeyLimits)
            if (not granted or f.metadata.get("granted")) and (not key or not f.metadata.get("token_only"))
        )

    def to_fields(self, names: tuple[str, ...] | None = None, prefix: str = "") -> dict[str, str]:
        """The limits (all, or `names`) as a record's fields, `prefix` before each name."""
        return {prefix + name: repr(getattr(self, name)) for name in names or self.names()}

    @classmethod
    def from_fields(cls, raw: Mapping[str, str], prefix: str = "") -> KeyLimits:
        """Read back by name; a field the record lacks (written before it existed) is no limit."""
        return cls(**_values(raw, prefix, cls.names()))

    def capped_by(self, key: KeyLimits) -> KeyLimits:
        """A browser token's limits: its granted ones, each never above `key`'s (0 takes the key's)."""
        capped: dict[str, Any] = {
            name: _tighter(getattr(self, name), getattr(key, name)) for name in self.names(granted=True)
        }
        return KeyLimits(**capped)

    def granted_under(self, token: KeyLimits | None) -> KeyLimits:
        """What a session opened with this key (through `token`, if any) is granted: each granted
        limit the token's where it sets one (capped at mint), else the key's."""
        granted: dict[str, Any] = {
            name: (getattr(token, name) if token is not None else 0) or getattr(self, name)
            for name in self.names(granted=True)
        }
        return KeyLimits(**granted)


@dataclass(frozen=True, slots=True)
class AuthLimits(KeyLimits):
    """The limits a session was opened under with auth on (the granted ones of `KeyLimits`, the
    others 0) and its API key's SHA-256 digest."""

    key_sha256: str = field(kw_only=True)

    @classmethod
    def grant(cls, key_sha256: str, limits: KeyLimits) -> AuthLimits:
        granted: dict[str, Any] = {name: getattr(limits, name) for name in KeyLimits.names(granted=True)}
        return cls(key_sha256=key_sha256, **granted)

    @classmethod
    def from_record(cls, key_sha256: str, raw: Mapping[str, str], prefix: str) -> AuthLimits:
        """Read back from a record's fields by name (`prefix` before each), missing ones 0."""
        return cls(key_sha256=key_sha256, **_values(raw, prefix, KeyLimits.names(granted=True)))


def _values(raw: Mapping[str, str], prefix: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The limits `names` that `raw` holds (`prefix` before each name), each of its field's type."""
    kinds = {f.name: float if f.type in (float, "float") else int for f in dataclasses.fields(KeyLimits)}
    return {name: kinds[name](raw[prefix + name]) for name in names if prefix + name in raw}


def _tighter(a: float, b: float) -> float:
    """The tighter of two limits where 0 means none."""
    if not a:
        return b
    if not b:
        return a
    return min(a, b)
