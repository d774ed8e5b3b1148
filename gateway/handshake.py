"""Subprotocol negotiation for `/v1/realtime`: which dialect and encoding a socket speaks
(docs/design.md section 3, docs/protocol.md "Dialects").

Why at the handshake: the dialect and encoding are fixed for the life of the socket, and a client
that only offers subprotocols we do not speak must be refused (HTTP 403) before it can send a frame
we would misread.

- A `microturn.v1.json` or `microturn.v1.msgpack` offer selects microturn's native protocol in that
  encoding, and that subprotocol is echoed.
- No microturn subprotocol selects the OpenAI Realtime dialect (gateway/openai/): no subprotocol at
  all (the official Python SDK), or `realtime` (OpenAI's browser SDK, echoed back).
- Anything else only: refused.

Credential subprotocols, `microturn.bearer.<token>` and OpenAI's `openai-insecure-api-key.<secret>`
(gateway/auth/credentials.py), are left out of the choice and never echoed back, so a secret is not
reflected into responses, logs or proxies that record them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from shared.protocol.codec import Encoding, choose_encoding

BEARER_SUBPROTOCOL_PREFIX: Final = "microturn.bearer."
OPENAI_KEY_SUBPROTOCOL_PREFIX: Final = "openai-insecure-api-key."
OPENAI_SUBPROTOCOL: Final = "realtime"
CREDENTIAL_PREFIXES: Final = (BEARER_SUBPROTOCOL_PREFIX, OPENAI_KEY_SUBPROTOCOL_PREFIX)

DialectKind = Literal["native", "openai"]


@dataclass(frozen=True, slots=True)
class Negotiated:
    encoding: Encoding
    # The subprotocol to echo in the handshake answer; None when the client offered none.
    subprotocol: str | None
    dialect: DialectKind = "native"


def _names(offered: Iterable[str]) -> list[str]:
    return [
        name.strip() for name in offered if name.strip() and not name.strip().startswith(CREDENTIAL_PREFIXES)
    ]


def negotiate(offered: Iterable[str]) -> Negotiated | None:
    """The dialect, encoding and echoed subprotocol for a client's offer; None means refuse."""
    names = _names(offered)
    native = {e.value for e in Encoding}
    if any(name in native for name in names):
        encoding = choose_encoding(names)
        assert encoding is not None
        return Negotiated(encoding, encoding.subprotocol)
    if not names:
        return Negotiated(Encoding.JSON, None, "openai")
    if OPENAI_SUBPROTOCOL in names:
        return Negotiated(Encoding.JSON, OPENAI_SUBPROTOCOL, "openai")
    return None
