"""The Realtime conversation as the client sees it: items in order, bounded, and what each one puts into the engine.

The engine keeps the conversation as tokens and knows nothing of items; :class:`ConversationItems` is the
dialect's table of them (``conversation.item.*``), in conversation order, within :data:`MAX_ITEMS` items and
:data:`MAX_ITEM_CHARS` characters: beyond them the oldest items leave the table (``retrieve``, ``delete`` and
``truncate`` of them then get the not-found error). The thinker's own context is far smaller, so the model has long
stopped seeing them; the bound is the server's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from engine_bridge import protocol as p
from livekit_omni.realtime import wire

MAX_ITEMS: Final = 1000
MAX_ITEM_CHARS: Final = 1_000_000


@dataclass(slots=True)
class ItemRecord:
    """One conversation item: its wire form, and what the projection knows about it."""

    item: wire.Item
    #: Assistant items: audio sent (ms) and the words with their end (ms within the item's audio).
    audio_ms: int = 0
    words: list[tuple[str, int]] = field(default_factory=list)
    #: User items: the turn's start on the engine's input clock (VAD), or the span of the engine's input a manual
    #: commit was fed into (to match the transcript to its item).
    start_ms: int | None = None
    end_ms: int | None = None
    #: Assistant items: the engine reply (turn) whose words the conversation holds.
    turn_id: int | None = None
    #: Characters of text the item brought (what counts against MAX_ITEM_CHARS).
    chars: int = 0

    @property
    def id(self) -> str:
        assert self.item.id is not None
        return self.item.id


class ConversationItems:
    """Item id -> record, in conversation order, within the table's bounds."""

    def __init__(self) -> None:
        self.records: dict[str, ItemRecord] = {}
        self._chars = 0
        #: Items that left the table at its bounds.
        self.forgotten = 0

    def __contains__(self, item_id: object) -> bool:
        return item_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def last_id(self) -> str | None:
        return next(reversed(self.records)) if self.records else None

    def get(self, item_id: str, code: str, what: str) -> ItemRecord:
        """The record of ``item_id``; the dialect's not-found error (``code``) for ``what`` otherwise."""
        rec = self.records.get(item_id)
        if rec is None:
            raise wire.WireError(
                code, f"Error {what} item: the item with id '{item_id}' does not exist.", param="item_id"
            )
        return rec

    def remember(self, rec: ItemRecord) -> None:
        """Put ``rec`` in the table, then keep the table within its bounds by forgetting the oldest items (never
        ``rec`` itself)."""
        it = rec.item
        rec.chars = len(it.arguments or "") + len(it.output or "")
        rec.chars += sum(len(c.text or "") + len(c.transcript or "") for c in it.content or [])
        self.records[rec.id] = rec
        self._chars += rec.chars
        while len(self.records) > MAX_ITEMS or (self._chars > MAX_ITEM_CHARS and len(self.records) > 1):
            oldest = next(k for k in self.records if k != rec.id)
            self._chars -= self.records.pop(oldest).chars
            self.forgotten += 1

    def move_first(self, rec: ItemRecord) -> None:
        """``rec`` first in the table (an item created with ``previous_item_id: "root"``)."""
        self.records = {rec.id: rec, **{k: v for k, v in self.records.items() if k != rec.id}}

    def delete(self, item_id: str) -> None:
        self._chars -= self.records.pop(item_id).chars


@dataclass(frozen=True, slots=True)
class ItemAppend:
    """What an item puts into the engine's conversation: an ``AppendText`` of ``kind`` (nothing when it has no
    text and no call)."""

    kind: p.AppendKind
    text: str
    call_id: str = ""
    call: p.ToolCallItem | None = None

    @property
    def empty(self) -> bool:
        return not self.text and self.call is None and self.kind != "tool_result"


def engine_text(it: wire.Item, param: str = "item") -> ItemAppend:
    """What ``it`` puts into the engine's conversation: a function call as the assistant's call, its output as the
    tool's result (refused without a ``call_id``), a message as text of its role."""
    if it.type in ("function_call", "function_call_output") and not it.call_id:
        raise wire.WireError(
            "missing_required_parameter", f"{it.type} needs a call_id", param=f"{param}.call_id"
        )
    if it.type == "function_call_output":
        return ItemAppend("tool_result", it.output or "", call_id=it.call_id or "")
    if it.type == "function_call":
        if not it.name:
            raise wire.WireError(
                "missing_required_parameter", "function_call needs a name", param=f"{param}.name"
            )
        call = p.ToolCallItem(call_id=it.call_id or "", name=it.name, arguments=it.arguments or "{}")
        return ItemAppend("tool_call", "", call=call)
    texts = [c.text or c.transcript or "" for c in it.content or [] if c.type != "input_image"]
    text = " ".join(t for t in texts if t).strip()
    if it.role == "assistant":
        return ItemAppend("assistant", text)
    if it.role == "system":
        return ItemAppend("thinking", text)
    return ItemAppend("user", text)


def stored_part(c: wire.ContentPart) -> wire.ContentPart:
    """A content part as the table keeps it: no audio or image bytes (``retrieve`` returns transcripts only)."""
    ctype = c.type or "input_text"
    if ctype == "text":
        ctype = "output_text"
    return wire.ContentPart(type=ctype, text=c.text, transcript=c.transcript)


def function_call_item(call: p.ToolCallItem, *, status: str, arguments: str | None = None) -> wire.Item:
    """The ``function_call`` item of a call the model made (``arguments``: None for the whole call's)."""
    return wire.Item(
        id=wire.new_id("item"),
        type="function_call",
        object="realtime.item",
        status=status,
        call_id=call.call_id,
        name=call.name,
        arguments=call.arguments if arguments is None else arguments,
    )


def snapshot(item: wire.Item, *, content: list[wire.ContentPart]) -> wire.Item:
    return wire.Item(
        id=item.id, type=item.type, object=item.object, status=item.status, role=item.role, content=content
    )
