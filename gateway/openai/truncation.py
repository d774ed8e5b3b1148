"""`session.truncation` -> the session's context window (docs/protocol.md, "Context window").

OpenAI's GA values, and what each becomes in the microturn session under the conversation:
- `"auto"` (also when unset, as OpenAI's default): `context_policy: truncate` with the default
  `retention_ratio` (0.8): past the model's context the window is cut to 80 % of it, rarely;
- `{"type": "retention_ratio", "retention_ratio": r}`: the same with r, in (0, 1];
- `"disabled"`: `context_policy: error`: past the context a response fails with `context_full`.
In every truncating case the instructions are the kept prefix (`keep_prefix_text`: the system
message as the template renders it), as OpenAI keeps instructions out of what it truncates.
`token_limits.post_instructions` is accepted and echoed, but the limit is the model's context: the
gateway has no tokenizer to count the instructions with.

The window is fixed when the session opens underneath (the first item or response), so a change
after that is refused, as for `temperature`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from gateway.openai.errors import BadEvent
from shared.protocol.messages import ContextPolicy, OpenConfig

JSON = Any
PARAM: Final = "session.truncation"


# The session option's default (OpenConfig.retention_ratio), read off a default config.
DEFAULT_RATIO: Final = OpenConfig().retention_ratio


@dataclass(frozen=True, slots=True)
class Truncation:
    policy: ContextPolicy
    retention_ratio: float = DEFAULT_RATIO


AUTO: Final = Truncation("truncate")


def parse_truncation(value: JSON, event_id: str | None) -> Truncation:
    """The window a `truncation` value asks for (None: unset, OpenAI's `"auto"`); BadEvent if bad."""
    if value is None or value == "auto":
        return AUTO
    if value == "disabled":
        return Truncation("error")
    if isinstance(value, dict) and value.get("type") == "retention_ratio":
        unknown = set(value) - {"type", "retention_ratio", "token_limits"}
        if unknown:
            raise BadEvent(
                f"unknown truncation field {sorted(unknown)[0][:64]!r}",
                event_id,
                code="unknown_parameter",
                param=PARAM,
            )
        ratio = value.get("retention_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise BadEvent(
                "session.truncation.retention_ratio must be a number above 0 and at most 1",
                event_id,
                param=f"{PARAM}.retention_ratio",
            )
        limits = value.get("token_limits")
        post = None if not isinstance(limits, dict) else limits.get("post_instructions")
        if limits is not None and (
            not isinstance(limits, dict)
            or set(limits) - {"post_instructions"}
            or (post is not None and (isinstance(post, bool) or not isinstance(post, int) or post < 1))
        ):
            raise BadEvent(
                "session.truncation.token_limits takes post_instructions, a positive integer",
                event_id,
                param=f"{PARAM}.token_limits",
            )
        return Truncation("truncate", float(ratio))
    raise BadEvent(
        'session.truncation must be "auto", "disabled" or {"type": "retention_ratio", "retention_ratio": r}',
        event_id,
        param=PARAM,
    )
