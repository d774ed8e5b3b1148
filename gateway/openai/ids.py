"""Ids shaped as OpenAI's: a prefix, an underscore, then random letters and digits (`event_...`,
`item_...`, `call_...`, `resp_...`, `sess_...`, `conv_...`). Clients only compare them, never parse them."""

from __future__ import annotations

import secrets
import string
from typing import Final

_ALPHABET: Final = string.ascii_letters + string.digits
_LENGTH: Final = 22


def new_id(prefix: str) -> str:
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(_LENGTH))


def event_id() -> str:
    return new_id("event")


def item_id() -> str:
    return new_id("item")


def response_id() -> str:
    return new_id("resp")


def session_id() -> str:
    return new_id("sess")


def conversation_id() -> str:
    return new_id("conv")


def call_id() -> str:
    return new_id("call")
