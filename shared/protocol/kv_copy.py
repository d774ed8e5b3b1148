"""The KV copy stream: a draining worker sends a session's KV pages to the worker taking it over.

A make-before-break drain (docs/failover.md, "Drain") moves each session's KV, not only its token
log: the draining worker dials the target's `/v1/kv` (`KV_COPY_PATH`, with the link secret, as the
link: shared/protocol/link_client.py) and, per session, in order on one stream:

    sender   `kv` header (msgpack map): sid, config, the KV's meaning (`KVFormat`), the tokens the
             pages cover, the page count, a CRC-32 of the payload
    target   `kv_ready` (send the pages) or `kv_refused` (reason), decided from the header alone
    sender   the payload: binary frames of whole pages, page-major (each page's bytes for every
             layer, keys then values, in the sender's pool layout), at most `KV_FRAME_PAGES`
             pages and `KV_FRAME_BYTES` each
    target   `kv_stored` (the copy holds the KV, in its host tier or on its device) or `kv_refused`

A refusal is never an error of the session: the sender counts it by `reason` and asks for the
rebuild from the log instead (`warm` on the link, worker/server/warm.py). A stream that breaks
mid-copy refuses every session not yet `kv_stored` (`stream`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import ClassVar, Final, Literal, TypeAlias

import msgpack

from shared.errors import InvalidMessage
from shared.protocol.fields import show
from shared.protocol.link_codec import from_wire, to_wire
from shared.protocol.messages import OpenConfig

# The worker's route for the stream, beside `/v1/link`.
KV_COPY_PATH: Final = "/v1/kv"
# Pages per payload frame, and its bytes at most (whole pages, at least one): a frame is written
# into the target's buffer as it arrives, and stays under the worker server's WebSocket message
# bound (uvicorn's 16 MiB by default).
KV_FRAME_PAGES: Final = 64
KV_FRAME_BYTES: Final = 8 * 2**20
# A frame's size bound on the stream (the link's own stays small).
KV_MAX_FRAME_BYTES: Final = 256 * 2**20

# Why a copy fell back to the rebuild from the log (the sender's metric label and log line).
FallbackReason: TypeAlias = Literal[
    "model", "dtype", "page_size", "layout", "checksum", "stream", "room", "refused"
]
FALLBACK_REASONS: Final[tuple[FallbackReason, ...]] = (
    "model",
    "dtype",
    "page_size",
    "layout",
    "checksum",
    "stream",
    "room",
    "refused",
)


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What a page's bytes mean: two workers whose formats are equal can take each other's pages."""

    # A fingerprint of the weights and the model's config: another model, or other weights under
    # the same name (a different seed, a re-quantized file), gives another one.
    model: str
    dtype: str
    page_size: int
    layout: str
    page_bytes: int

    def mismatch(self, other: KVFormat) -> FallbackReason | None:
        """Why pages of `other` cannot be used here (None: they can)."""
        if other.model != self.model:
            return "model"
        if other.dtype != self.dtype:
            return "dtype"
        if other.page_size != self.page_size:
            return "page_size"
        if other.layout != self.layout or other.page_bytes != self.page_bytes:
            return "layout"
        return None


@dataclass(frozen=True, slots=True)
class KVHeader:
    op: ClassVar[str] = "kv"
    sid: str
    format: KVFormat
    # The session's tokens whose KV the pages hold (the first `len(tokens)` positions).
    tokens: tuple[int, ...]
    pages: int
    checksum: int  # CRC-32 of the whole payload
    config: OpenConfig = field(default_factory=OpenConfig)


@dataclass(frozen=True, slots=True)
class KVReady:
    op: ClassVar[str] = "kv_ready"
    sid: str


@dataclass(frozen=True, slots=True)
class KVStored:
    op: ClassVar[str] = "kv_stored"
    sid: str
    tokens: int  # the tokens of the copy whose KV came over and is kept


@dataclass(frozen=True, slots=True)
class KVRefused:
    op: ClassVar[str] = "kv_refused"
    sid: str
    reason: FallbackReason
    detail: str = ""


KVFrame: TypeAlias = KVHeader | KVReady | KVStored | KVRefused
_CLASSES: Final[dict[str, type[KVFrame]]] = {c.op: c for c in (KVHeader, KVReady, KVStored, KVRefused)}


def encode_kv(frame: KVFrame) -> bytes:
    packed: bytes = msgpack.packb(to_wire(frame, {"op": frame.op}), use_bin_type=True)
    return packed


def decode_kv(data: bytes | str) -> KVFrame:
    """One control frame of the stream; raises `InvalidMessage` (a payload frame is not one)."""
    if isinstance(data, str):
        raise InvalidMessage("the KV copy stream's frames are binary")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise InvalidMessage(f"malformed msgpack: {str(e) or type(e).__name__}") from e
    if type(obj) is not dict or type(obj.get("op")) is not str:
        raise InvalidMessage(f"a KV copy frame must be a map with an op, got {show(obj)}")
    op = obj.pop("op")
    cls = _CLASSES.get(op)
    if cls is None:
        raise InvalidMessage(f"unknown KV copy op {op[:40]!r}")
    return from_wire(cls, obj, f"kv {op}")


def checksum(chunks: list[memoryview]) -> int:
    """The CRC-32 of the payload, its frames in order."""
    value = 0
    for chunk in chunks:
        value = zlib.crc32(chunk, value)
    return value
