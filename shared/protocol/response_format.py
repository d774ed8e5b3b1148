"""`response_format`: the shape a turn's output must take (structured output, docs/protocol.md).

A turn (`input.chunk`) or a session (`session.open`'s config, the default of its turns) may ask
for output that matches a JSON schema, a regular expression, one of a few strings, or an xgrammar
structural tag (text and tagged JSON in sequence: the OpenAI dialect's tool calls,
gateway/openai/tools.py). The worker
compiles it into a grammar (worker/engine/grammar.py) and masks every sampled token to it.

Why the bounds: a grammar's compile time and memory grow with the schema, and compiling runs on
the worker for everyone's sessions. Anything past these sizes is refused at the codec with
`invalid_message`, before it reaches a worker; what the grammar library itself rejects (an
unsupported schema keyword, a malformed regex) is refused by the worker, also `invalid_message`,
with the library's message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

ResponseFormatType: TypeAlias = Literal["json_schema", "regex", "choice", "structural_tag"]
RESPONSE_FORMAT_TYPES: tuple[str, ...] = get_args(ResponseFormatType)

# A JSON schema's size, as compact JSON text (UTF-8 bytes); a structural tag's too (its schemas
# are most of it).
MAX_SCHEMA_BYTES = 16 * 1024
# A regex's length in characters.
MAX_PATTERN_CHARS = 1024
# `choice`: how many strings, and how long each (characters).
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 256


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """Exactly the field of its `type` is set (the codec enforces it): `schema` for `json_schema`
    (a JSON schema, a map), `pattern` for `regex`, `choices` for `choice`, `tag` for
    `structural_tag` (xgrammar's structural tag, a map with `type: "structural_tag"` and `format`)."""

    type: ResponseFormatType
    schema: dict[str, object] | None = None
    pattern: str | None = None
    choices: tuple[str, ...] | None = None
    tag: dict[str, object] | None = None

    def key(self) -> str:
        """The same text for the same format however its map was ordered: the grammar cache's key."""
        return json.dumps(
            [self.type, self.schema, self.pattern, self.choices, self.tag],
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        )

    def __hash__(self) -> int:
        # `schema` and `tag` are maps (unhashable); equal formats have equal keys.
        return hash(self.key())


def schema_bytes(schema: object) -> int:
    """A schema's size as `MAX_SCHEMA_BYTES` measures it."""
    return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
