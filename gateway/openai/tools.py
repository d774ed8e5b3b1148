"""Function tools in the OpenAI dialect: the session's `tools` and `tool_choice`, how they are
written into the conversation, and the grammar a response's call is held to.

The format (docs/protocol.md "Tools"), Hermes's, as Qwen2.5's and SmolLM3's chat templates write
it:
- the tools: the model's chat template lists them when it has a tools section of its own
  (`ChatTemplate.has_tools_section`: it is given them as transformers gives them, `as_template`);
  otherwise (SmolLM2's template has none) a section appended to the system message (after the
  instructions, if any) lists each function as one line of JSON inside `<tools></tools>`
  (`tools_section`);
- a call: the assistant's text `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`
  (`call_text`), kept in the conversation exactly as generated;
- a call's output: a `tool` message for a template with a tools section (Qwen2.5's renders it as
  `<tool_response>`), else a user message `<tool_response>\\nOUTPUT\\n</tool_response>`
  (`output_message`).

Why a grammar: `required` and a named function are held to exactly one such call by an xgrammar
structural tag (`constraint`: the call's arguments match the function's JSON schema, always
well-formed); `auto` lets the model write text and, once it writes `<tool_call>`, holds the rest
of the call to the same tag; `none` leaves the output free and reads it all as text. One call per
response: the grammar ends after the first, and the response then ends.

Sans-I/O; every parse validates before the dialect changes anything (`BadEvent`/`RealtimeProblem`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from gateway.openai.errors import BadEvent, RealtimeProblem
from shared.protocol.response_format import MAX_SCHEMA_BYTES, ResponseFormat, schema_bytes

CALL_TRIGGER: Final = "<tool_call>"
CALL_PREFIX: Final = '<tool_call>\n{"name": "'
ARGUMENTS_PREFIX: Final = '", "arguments": '
CALL_END: Final = "}\n</tool_call>"
MAX_TOOLS: Final = 128
MAX_NAME_CHARS: Final = 64  # OpenAI's bound on a function's name
MAX_DESCRIPTION_CHARS: Final = 4096
_NAME_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

_SECTION_HEAD: Final = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_SECTION_TAIL: Final = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: Mapping[str, Any]  # a JSON schema (an object's)

    def signature(self) -> dict[str, Any]:
        """Its name, description and parameters (the `function` of a Chat Completions tool)."""
        described = {} if self.description is None else {"description": self.description}
        return {"name": self.name, **described, "parameters": dict(self.parameters)}

    def as_dict(self) -> dict[str, Any]:
        """As a session echoes it (OpenAI's `RealtimeFunctionTool`)."""
        return {"type": "function", **self.signature()}


@dataclass(frozen=True, slots=True)
class NamedFunction:
    name: str


ToolChoice: TypeAlias = Literal["auto", "none", "required"] | NamedFunction


def _bad(message: str, event_id: str | None, param: str, code: str = "invalid_value") -> BadEvent:
    return BadEvent(message, event_id, code=code, param=param)


def parse_tools(value: object, param: str, event_id: str | None) -> tuple[FunctionTool, ...]:
    """A `tools` list: function tools only (an MCP tool needs an MCP client, which this server does
    not run), each with a valid name (unique) and an object schema for its parameters."""
    if not isinstance(value, list):
        raise _bad(f"{param} must be a list", event_id, param, "invalid_type")
    if len(value) > MAX_TOOLS:
        raise _bad(f"{param}: at most {MAX_TOOLS} tools", event_id, param)
    tools: list[FunctionTool] = []
    for index, raw in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(raw, dict):
            raise _bad(f"{where} must be an object", event_id, where, "invalid_type")
        kind = raw.get("type", "function")
        if kind == "mcp":
            raise _bad(
                f"{where}: MCP tools are not served (this server runs no MCP client); "
                "declare a function tool and run it in the client",
                event_id,
                f"{where}.type",
                "unsupported_value",
            )
        if kind != "function":
            raise _bad(f'{where}.type must be "function"', event_id, f"{where}.type", "unsupported_value")
        unknown = set(raw) - {"type", "name", "description", "parameters"}
        if unknown:
            name = sorted(unknown)[0][:64]
            raise _bad(f"unknown tool field {name!r}", event_id, where, "unknown_parameter")
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(
                f"{where}.name: a function tool needs a name",
                event_id,
                f"{where}.name",
                "missing_required_parameter",
            )
        if len(name) > MAX_NAME_CHARS or not set(name) <= _NAME_CHARS:
            raise _bad(
                f"{where}.name must be 1 to {MAX_NAME_CHARS} letters, digits, underscores or dashes",
                event_id,
                f"{where}.name",
            )
        if any(tool.name == name for tool in tools):
            raise _bad(f"{where}.name: a second tool named {name!r}", event_id, f"{where}.name")
        description = raw.get("description")
        if description is not None and (
            not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS
        ):
            raise _bad(
                f"{where}.description must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
                event_id,
                f"{where}.description",
            )
        parameters = raw.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise _bad(
                f"{where}.parameters must be a JSON schema of an object", event_id, f"{where}.parameters"
            )
        tools.append(FunctionTool(name, description, parameters))
    if tools and schema_bytes([tool.as_dict() for tool in tools]) > MAX_SCHEMA_BYTES:
        raise _bad(f"{param}: at most {MAX_SCHEMA_BYTES} bytes of tools as compact JSON", event_id, param)
    return tuple(tools)


def parse_tool_choice(value: object, param: str, event_id: str | None) -> ToolChoice:
    """`auto`, `none`, `required` or `{"type": "function", "name": ...}`; an MCP choice is refused."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict):
        if value.get("type") == "mcp":
            raise _bad(f"{param}: MCP tools are not served", event_id, param, "unsupported_value")
        name = value.get("name")
        if value.get("type") == "function" and isinstance(name, str) and set(value) <= {"type", "name"}:
            return NamedFunction(name)
    raise _bad(
        f'{param} must be "auto", "none", "required" or {{"type": "function", "name": ...}}',
        event_id,
        param,
    )


def check_choice(choice: ToolChoice, tools: Sequence[FunctionTool], param: str) -> None:
    """A choice the tools can satisfy: a named function among them, `required` with at least one."""
    if isinstance(choice, NamedFunction) and not any(tool.name == choice.name for tool in tools):
        raise RealtimeProblem(
            f"{param}: no function tool named {choice.name[:64]!r} in session.tools", param=param
        )
    if choice == "required" and not tools:
        raise RealtimeProblem(f'{param}: "required" needs at least one tool in session.tools', param=param)


def tools_section(tools: Sequence[FunctionTool]) -> str:
    """The tools as the system message lists them (the module's format)."""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in as_template(tools)]
    return _SECTION_HEAD + "".join("\n" + line for line in lines) + _SECTION_TAIL


def system_content(instructions: str | None, tools: Sequence[FunctionTool]) -> str | None:
    """The system message: the instructions, then the tools section (None: neither)."""
    if not tools:
        return instructions or None
    section = tools_section(tools)
    return f"{instructions}\n\n{section}" if instructions else section


def call_text(name: str, arguments: str, *, complete: bool = True) -> str:
    """A call as the assistant writes it; `complete=False`: as far as a call cut short got (its end
    never written)."""
    return CALL_PREFIX + name + ARGUMENTS_PREFIX + arguments + (CALL_END if complete else "")


def output_content(output: str) -> str:
    """A call's output as the user message that gives it to the model (a template without a tools
    section)."""
    return f"<tool_response>\n{output}\n</tool_response>"


def output_message(output: str, *, template_tools: bool) -> dict[str, str]:
    """The message of a call's output: a `tool` message for a template with a tools section (it
    knows the role), else a user message in the module's format."""
    if template_tools:
        return {"role": "tool", "content": output}
    return {"role": "user", "content": output_content(output)}


def as_template(tools: Sequence[FunctionTool]) -> list[dict[str, Any]]:
    """The tools as transformers passes them to a chat template (Chat Completions' shape)."""
    return [{"type": "function", "function": tool.signature()} for tool in tools]


def _call_tag(tool: FunctionTool) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": CALL_PREFIX + tool.name + ARGUMENTS_PREFIX,
        # At most one whitespace character between JSON tokens: a small model left free to pad
        # could spend its whole output on spaces inside a call.
        "content": {"type": "json_schema", "json_schema": dict(tool.parameters), "max_whitespace_cnt": 1},
        "end": CALL_END,
    }


def constraint(tools: Sequence[FunctionTool], choice: ToolChoice) -> ResponseFormat | None:
    """The grammar a response is held to (None: free text): exactly one call of one of the tools
    (`required`), of the named one, or text with at most one call once `<tool_call>` is written
    (`auto`). The tags are those xgrammar's own `get_model_structural_tag("qwen_3", ...)` builds;
    `required` differs in starting with the call (xgrammar's lets text come first, which a small
    model may never end)."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedFunction):
        fmt: dict[str, Any] = next(_call_tag(tool) for tool in tools if tool.name == choice.name)
    elif choice == "required":
        tags = [_call_tag(tool) for tool in tools]
        fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    else:
        fmt = {
            "type": "triggered_tags",
            "triggers": [CALL_TRIGGER],
            "tags": [_call_tag(tool) for tool in tools],
            "stop_after_first": True,
        }
    return ResponseFormat("structural_tag", tag={"type": "structural_tag", "format": fmt})
