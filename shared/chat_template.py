"""A model's chat template, rendered as transformers renders it, and checked for what a persistent
session needs of it.

Rendering: jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` filter that keeps non-ASCII text, `raise_exception` and
`strftime_now` globals, and `messages`, `add_generation_prompt`, `bos_token`, `eos_token` in the
context: what `PreTrainedTokenizerBase.apply_chat_template` passes.

What a session needs (`check_extends`): a conversation streamed into one KV sequence item by item
is only the conversation the template means if rendering a longer conversation extends the
rendering of a shorter one, and if the generation prompt is where the assistant's reply then
starts. A template that rewrites earlier turns (a system prompt that moves, a date, the last
message marked differently) breaks that; it is found when the model loads and reported, instead of
a session silently diverging from the whole conversation rendered at once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

Message = Mapping[str, str]

# A conversation with every role, each message distinct, for the extension check.
_PROBE: tuple[Message, ...] = (
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Thanks"},
)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @cached_property
    def _compiled(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        return env.from_string(self.source)

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """`tools`: function tools in the Chat Completions shape (`{"type": "function", "function":
        {...}}`), as transformers passes them to a template with a tools section."""
        return self._compiled.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=None if tools is None else [dict(tool) for tool in tools],
        )

    @cached_property
    def has_tools_section(self) -> bool:
        """Whether the template writes the tools it is given (a tools section of its own): a
        conversation renders differently with a tool than without."""
        probe = _PROBE[1:3]
        tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}
        try:
            return self.render(probe, tools=[tool]) != self.render(probe)
        except jinja2.TemplateError:
            return False

    def check_extends(self) -> str | None:
        """None when every prefix of the probe conversation renders as a prefix of the next, with
        the generation prompt a prefix of the assistant's turn; else what breaks."""
        try:
            previous = self.render(_PROBE[:1])
            for end in range(2, len(_PROBE) + 1):
                head = _PROBE[: end - 1]
                current = self.render(_PROBE[:end])
                if not current.startswith(previous):
                    return f"rendering {end} messages does not extend rendering {end - 1}"
                if _PROBE[end - 1]["role"] == "assistant":
                    prompt = self.render(head, add_generation_prompt=True)
                    if not current.startswith(prompt) or not prompt.startswith(previous):
                        return f"the generation prompt after {end - 1} messages is not where the reply starts"
                previous = current
        except jinja2.TemplateError as exc:
            return f"the template does not render: {exc}"
        return None
