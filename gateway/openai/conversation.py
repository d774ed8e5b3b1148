"""The conversation of one OpenAI-dialect socket: its items, and the text each one appends to the
session's single KV sequence, rendered with the model's own chat template.

Why text deltas of one rendering: a conversation streamed item by item into one KV sequence is the
conversation the template means only if each append is exactly what rendering the longer
conversation adds to rendering the shorter one (shared/chat_template.py `check_extends`). So each
append is `render(messages + [new])` minus `render(messages)`, checked to extend it; a reply is
what the model generated, kept as generated (never re-tokenized), and the template's text after
the reply's content (its end marker, e.g. `<|im_end|>\n`) is owed to the next append, less the stop
token the model itself sampled (which is already in the KV). A reply cut by `max_output_tokens` or
a cancel thus gets the whole end marker. Turn N costs only its own new tokens.

A reply that called a tool is one assistant message to the model (its text as generated, the call's
`<tool_call>` markup included, tools.py) and several items to the client (its text, its call,
calling_response.py): each of those items keeps its reply's id (`Item.reply_id`), and the items of
one reply spell its text in order (`Item.written`). So what is left of a reply once some of its
items are deleted is the assistant message its remaining items spell (`message_of`): all of them,
the reply as generated; its text alone, without the call; its call alone, without the text.

Sans-I/O: no native messages here; the dialect turns the appends into chunks. Every method
validates before it changes anything, raising `RealtimeProblem`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, cast

import jinja2

from gateway.openai import server_events as ev
from gateway.openai.client_events import NewItem, Role
from gateway.openai.errors import RealtimeProblem
from gateway.openai.ids import item_id as new_item_id
from gateway.openai.tools import FunctionTool, as_template, call_text, output_message, system_content
from shared.chat_template import ChatTemplate, Message

# An item's id, as OpenAI's: at most 64 characters (also the client's own ids).
MAX_ITEMS: Final = 100_000


ItemType = Literal["message", "function_call", "function_call_output"]


@dataclass(slots=True)
class Item:
    item_id: str
    role: Role
    text: str  # a message's text, a call output's output
    status: str = "completed"
    # A model's tool call or a client's output of one (tools.py): `call_id` links the two.
    type: ItemType = "message"
    call_id: str | None = None
    name: str | None = None  # a call's function
    arguments: str | None = None  # a call's arguments, JSON text as generated
    # A model's reply: the id its response gave its first item, shared by all the reply's items
    # (one assistant message to the model; None: a client's item, its own message).
    reply_id: str | None = None

    @property
    def written(self) -> str:
        """Its part of its reply's text as the model wrote it: a message's text; a call's markup,
        with its end only when the call was completed (calling_response.py closes a call cut short
        `incomplete`). In order, a reply's items spell the reply (call_parser.py splits all of it)."""
        if self.type != "function_call":
            return self.text
        return call_text(self.name or "", self.arguments or "", complete=self.status == "completed")

    def as_event(self, status: str | None = None) -> ev.Event:
        shown = cast(ev.ItemStatus, status or self.status)
        if self.type == "function_call":
            return ev.function_call_item(
                self.item_id, self.call_id or "", self.name or "", self.arguments or "", shown
            )
        if self.type == "function_call_output":
            return ev.function_call_output_item(self.item_id, self.call_id or "", self.text)
        return ev.message_item(self.item_id, self.role, self.text, shown)


def message_of(items: Sequence[Item], *, template_tools: bool) -> Message:
    """The one message `items` are to the model: what is left of one reply (the assistant message
    its items spell), or one client item (a call's output as tools.py's `output_message`)."""
    first = items[0]
    if first.reply_id is not None:
        assert all(item.reply_id == first.reply_id for item in items), "one reply's items"
        return {"role": "assistant", "content": "".join(item.written for item in items)}
    assert len(items) == 1, "a client's item is a message of its own"
    if first.type == "function_call_output":
        return output_message(first.text, template_tools=template_tools)
    return {"role": first.role, "content": first.text}


@dataclass(slots=True)
class _Prompt:
    """A response under way: the rendering with the generation prompt, and what it owed before."""

    rendered: str
    owed_before: str


@dataclass(frozen=True, slots=True)
class Mark:
    """The conversation right before an item joined (issue #35): what deleting it goes back to."""

    items: int
    messages: int
    rendered: int  # a prefix of every later rendering
    owed: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    items: list[Item]
    messages: list[Message]
    rendered: str
    owed: str
    prompt: _Prompt | None
    ids: set[str]
    calls: set[str]
    marks: dict[str, Mark] = field(default_factory=dict)


@dataclass(slots=True)
class Conversation:
    template: ChatTemplate
    max_item_chars: int
    instructions: str | None = None
    tools: tuple[FunctionTool, ...] = ()  # listed in the system message (tools.py)
    items: list[Item] = field(default_factory=list)
    _messages: list[Message] = field(default_factory=list)
    _rendered: str = ""  # render(_messages): what the KV holds, less `_owed`
    _owed: str = ""  # template text the KV still lacks, sent with the next append
    _prompt: _Prompt | None = None
    _ids: set[str] = field(default_factory=set)
    _calls: set[str] = field(default_factory=set)  # the call ids of the model's tool calls
    # Each item's `Mark` (a reply's is taken when its response begins, in `_reply_mark`).
    marks: dict[str, Mark] = field(default_factory=dict)
    _reply_mark: Mark | None = None
    # Set once the session keeps the system message as its prefix (`pin_instructions`): going back
    # to before the first item keeps it, as the session's KV does.
    _floor: Mark | None = None

    @property
    def started(self) -> bool:
        """True once anything was appended: the instructions are then part of the KV."""
        return bool(self._messages)

    @property
    def last_item_id(self) -> str | None:
        return self.items[-1].item_id if self.items else None

    def find(self, item_id: str) -> Item | None:
        return next((item for item in self.items if item.item_id == item_id), None)

    def checkpoint(self) -> Checkpoint:
        """The state to go back to should the event that changes it next be refused after all."""
        return Checkpoint(
            list(self.items),
            list(self._messages),
            self._rendered,
            self._owed,
            self._prompt,
            set(self._ids),
            set(self._calls),
            dict(self.marks),
        )

    def rollback(self, cp: Checkpoint) -> None:
        self.items, self._messages, self._rendered = list(cp.items), list(cp.messages), cp.rendered
        self._owed, self._prompt, self._ids = cp.owed, cp.prompt, set(cp.ids)
        self._calls = set(cp.calls)
        self.marks = dict(cp.marks)

    def mark(self) -> Mark:
        return Mark(len(self.items), len(self._messages), len(self._rendered), self._owed)

    def pin_instructions(self, prefix: str) -> None:
        """The session keeps `prefix` (the system message alone, `instructions_prefix`) as its first
        tokens across everything (truncation on): going back to before the first item keeps it."""
        assert self._messages, "pinned before the first append"
        self._floor = Mark(0, 1, len(prefix), "")

    def back_to(self, mark: Mark) -> list[Item]:
        """The conversation as it was at `mark` (an item's, which is deleted with all after it);
        returns the items after it, which the caller appends again. A pinned system message stays:
        the items appended next render after it, as the session's KV holds it."""
        if self._floor is not None and mark.rendered < self._floor.rendered:
            mark = Mark(mark.items, self._floor.messages, self._floor.rendered, self._floor.owed)
        later = self.items[mark.items :]
        self.items, self._messages = self.items[: mark.items], self._messages[: mark.messages]
        self._rendered, self._owed, self._prompt = self._rendered[: mark.rendered], mark.owed, None
        self._ids = {item.item_id for item in self.items}
        self._calls = {i.call_id for i in self.items if i.type == "function_call" and i.call_id}
        self.marks = {i: m for i, m in self.marks.items() if i in self._ids}
        return later

    def set_instructions(self, instructions: str) -> None:
        if self.started and instructions != (self.instructions or ""):
            raise RealtimeProblem(
                "session.instructions can only change before the first item: they are the system "
                "message at the start of the conversation, already in the model's KV cache",
                param="session.instructions",
                code="unsupported_value",
            )
        if len(instructions) > self.max_item_chars:
            raise RealtimeProblem(
                f"session.instructions: at most {self.max_item_chars} characters",
                param="session.instructions",
            )
        self.instructions = instructions or None

    def set_tools(self, tools: tuple[FunctionTool, ...]) -> None:
        """The tools the system message lists: like the instructions, fixed once anything is in."""
        if self.started and tools != self.tools:
            raise RealtimeProblem(
                "session.tools can only change before the first item: they are listed in the system "
                "message at the start of the conversation, already in the model's KV cache",
                param="session.tools",
                code="unsupported_value",
            )
        self.tools = tools

    def instructions_prefix(self) -> str | None:
        """The instructions as the template renders them alone (the system message): the text a
        conversation starting with them begins with, which a session keeps across window cuts
        (`keep_prefix_text`). None without instructions, or when the template renders the system
        message alone as no prefix of a conversation that starts with it."""
        content = self._system_content()
        if content is None:
            return None
        system: list[Message] = [{"role": "system", "content": content}]
        tools = self._template_tools()
        try:
            alone = self.template.render(system, add_generation_prompt=False, tools=tools)
            probe = self.template.render(
                [*system, {"role": "user", "content": "."}], add_generation_prompt=False, tools=tools
            )
        except jinja2.TemplateError:
            return None
        return alone if alone and probe.startswith(alone) else None

    def check(
        self,
        new: NewItem,
        previous_item_id: str | None,
        last_item_id: str | None,
        calls_before: frozenset[str] = frozenset(),
    ) -> None:
        """Refuse an item that could not join after `last_item_id`; changes nothing.

        `last_item_id` is the last item's id as the item will find it: the current last one, or,
        for an item queued behind a running response, the last of what joins before it; a call
        output's `call_id` must name a call of the conversation or one in `calls_before` (the
        running response's).
        """
        if new.call_id is not None and new.call_id not in self._calls and new.call_id not in calls_before:
            raise RealtimeProblem(
                f"item.call_id: no function_call with call_id {new.call_id[:64]!r} in the conversation",
                param="item.call_id",
            )
        if previous_item_id is not None and previous_item_id != (last_item_id or "root"):
            raise RealtimeProblem(
                "previous_item_id: items can only be appended after the last item "
                f"({last_item_id or 'root'!r}): the conversation is one KV sequence",
                param="previous_item_id",
            )
        self._refuse_taken([] if new.item_id is None else [new.item_id])
        if len(new.text) > self.max_item_chars:
            raise RealtimeProblem(
                f"item.content: at most {self.max_item_chars} characters per item", param="item.content"
            )
        self._refuse_beyond_room(1)

    def append(self, new: NewItem, previous_item_id: str | None) -> tuple[Item, str]:
        """Add a message item; returns it and the text to append to the session."""
        self._no_response()
        self.check(new, previous_item_id, self.last_item_id)
        item = Item(new.item_id or new_item_id(), new.role, new.text)
        if new.call_id is not None:
            item = Item(item.item_id, "user", new.text, type="function_call_output", call_id=new.call_id)
        return item, self._join([item])

    def rejoin(self, items: Sequence[Item]) -> str:
        """Items that left with `back_to` (or copies of them) join again as they were (ids, call ids,
        statuses): one client item, or what is left of one reply, as the one message they are to
        the model (`message_of`). A call's output joins even when its call was deleted: it is the
        same tool message either way. Returns the text to append to the session."""
        self._no_response()
        self._refuse_taken([item.item_id for item in items])
        self._refuse_beyond_room(len(items))
        return self._join(items)

    def _refuse_taken(self, item_ids: Sequence[str]) -> None:
        taken = next((item_id for item_id in item_ids if item_id in self._ids), None)
        if taken is not None:
            raise RealtimeProblem(
                f"item.id {taken!r} already exists", param="item.id", code="duplicate_item_id"
            )

    def _refuse_beyond_room(self, joining: int) -> None:
        if len(self.items) + joining > MAX_ITEMS:
            raise RealtimeProblem(f"at most {MAX_ITEMS} items per conversation", code="too_many_items")

    def _no_response(self) -> None:
        if self._prompt is not None:
            raise RealtimeProblem(
                "an item cannot be added while a response is being generated: it waits for the response",
                code="conversation_already_has_active_response",
            )

    def _join(self, items: Sequence[Item]) -> str:
        """`items` (one message's, checked) join after the last item; the text they append."""
        mark = self.mark()
        messages = [*self._head(), message_of(items, template_tools=self.template.has_tools_section)]
        rendered = self._render(messages, generation_prompt=False)
        text = self._owed + rendered[len(self._rendered) :]
        self._messages, self._rendered, self._owed = messages, rendered, ""
        for item in items:
            self.items.append(item)
            self._ids.add(item.item_id)
            if item.type == "function_call" and item.call_id is not None:
                self._calls.add(item.call_id)
            self.marks[item.item_id] = mark
        return text

    def begin_response(self) -> str:
        """The text that starts the assistant's reply (the owed text and the generation prompt)."""
        if self._prompt is not None:
            raise RealtimeProblem(
                "a response is already being generated: wait for response.done or cancel it",
                code="conversation_already_has_active_response",
            )
        self._reply_mark = self.mark()
        messages = self._head()
        prompt = self._render(messages, generation_prompt=True)
        text = self._owed + prompt[len(self._rendered) :]
        self._messages = messages
        self._prompt = _Prompt(prompt, self._owed)
        self._owed = ""
        return text

    def abandon_response(self) -> None:
        """The response's chunk was refused: nothing of it reached the KV."""
        if self._prompt is not None:
            self._owed = self._prompt.owed_before
            self._prompt = None

    def finish_response(
        self,
        reply: str,
        stop_text: str | None,
        item_id: str,
        status: str,
        shown: Sequence[Item] | None = None,
    ) -> Item:
        """The reply as generated; `stop_text` is the text of the stop token it ended with, if any;
        `shown`: the items the client sees for it instead of one message (its text and its tool
        call, calling_response.py), recorded in its place.

        Raises `RealtimeProblem` when the template does not render the reply where it was
        generated (then no later item could be appended exactly either).
        """
        prompt = self._prompt
        assert prompt is not None, "finish_response without begin_response"
        self._prompt = None
        messages = [*self._messages, {"role": "assistant", "content": reply}]
        rendered = self._render(messages, generation_prompt=False)
        if not rendered.startswith(prompt.rendered + reply):
            raise RealtimeProblem(
                "the model's chat template does not render the reply where it was generated; "
                "this conversation cannot go on exactly",
                code="template_not_streamable",
                kind="server_error",
            )
        tail = rendered[len(prompt.rendered) + len(reply) :]
        if stop_text and tail.startswith(stop_text):
            tail = tail[len(stop_text) :]
        self._messages, self._rendered, self._owed = messages, rendered, tail
        item = Item(item_id, "assistant", reply, status, reply_id=item_id)
        for recorded in [item] if shown is None else [replace(i, reply_id=item_id) for i in shown]:
            self.items.append(recorded)
            self._ids.add(recorded.item_id)
            if recorded.call_id is not None:
                self._calls.add(recorded.call_id)
            if self._reply_mark is not None:
                self.marks[recorded.item_id] = self._reply_mark
        return item

    def _head(self) -> list[Message]:
        """The messages so far; the instructions become the system message before the first."""
        content = self._system_content()
        if not self._messages and content is not None:
            return [{"role": "system", "content": content}]
        return list(self._messages)

    def _system_content(self) -> str | None:
        """The system message: the instructions, and the tools unless the template lists them."""
        return system_content(self.instructions, () if self.template.has_tools_section else self.tools)

    def _template_tools(self) -> list[dict[str, object]] | None:
        """The tools the template is given to list (a template with a tools section)."""
        return as_template(self.tools) if self.tools and self.template.has_tools_section else None

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        try:
            rendered = self.template.render(
                messages, add_generation_prompt=generation_prompt, tools=self._template_tools()
            )
        except jinja2.TemplateError as exc:
            raise RealtimeProblem(f"the model's chat template refuses this conversation: {exc}") from None
        if not rendered.startswith(self._rendered):
            raise RealtimeProblem(
                "the model's chat template rewrites earlier turns for this conversation, so it "
                "cannot be appended to the session's KV cache",
                code="template_not_streamable",
                kind="server_error",
            )
        return rendered
