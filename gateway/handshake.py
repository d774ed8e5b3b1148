"""Subprotocol negotiation for `/v1/realtime` (docs/design.md section 3).

Why its own step: the encoding is fixed for the life of the socket, and a client that only offers
subprotocols we do not speak must be refused at the handshake (HTTP 403), before it can send a
frame we would misread. No subprotocol at all means JSON, and then none is echoed back (echoing
one the client did not offer would make a conforming client fail the handshake).

A `microturn.bearer.<token>` subprotocol carries a browser's credential (gateway/auth/credentials.py), not an
encoding: it is left out of the negotiation, so it is never echoed back, and offering only it means
JSON with no subprotocol in the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shared.protocol.codec import Encoding, choose_encoding

BEARER_SUBPROTOCOL_PREFIX = "microturn.bearer."


@dataclass(frozen=True, slots=True)
class Negotiated:
    encoding: Encoding
    # The subprotocol to echo in the handshake answer; None when the client offered none.
    subprotocol: str | None


def negotiate(offered: Iterable[str]) -> Negotiated | None:
    """The encoding and echoed subprotocol for a client's offer; None means refuse the handshake."""
    names = [
        name.strip()
        for name in offered
        if name.strip() and not name.strip().startswith(BEARER_SUBPROTOCOL_PREFIX)
    ]
    encoding = choose_encoding(names)
    if encoding is None:
        return None
    return Negotiated(encoding, encoding.subprotocol if names else None)
