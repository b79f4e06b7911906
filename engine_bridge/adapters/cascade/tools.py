"""The engine protocol's function-tool types and the thinker's, both ways, in one place.

The protocol's (:class:`~engine_bridge.protocol.ToolDef`, ``ToolChoiceSpec``, ``ToolCallItem``) travel on the
control channel; the thinker's (:mod:`engine_bridge.thinker.tools`) are what it lists, constrains and parses. Voice
sessions (turns.py) and text requests (text.py) both convert here.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_bridge import protocol as p
from engine_bridge.thinker.base import ThinkerBackend
from engine_bridge.thinker.tools import ToolCall, ToolChoice, ToolSchemaError, ToolSpec


def tool_specs(defs: Sequence[p.ToolDef]) -> tuple[ToolSpec, ...]:
    """The thinker's tools; raises :class:`ToolSchemaError` for a bad name or a schema that is not a JSON schema."""
    return tuple(ToolSpec(d.name, d.description, dict(d.parameters)) for d in defs)


def tool_choice(spec: p.ToolChoiceSpec) -> ToolChoice:
    return ToolChoice(spec.mode, spec.name)


def call_item(call: ToolCall) -> p.ToolCallItem:
    return p.ToolCallItem(call_id=call.call_id, name=call.name, arguments=call.arguments)


def thinker_call(item: p.ToolCallItem) -> ToolCall:
    return ToolCall(item.call_id, item.name, item.arguments)


def tools_problem(thinker: ThinkerBackend, defs: Sequence[p.ToolDef], choice: p.ToolChoiceSpec) -> str | None:
    """Why the thinker could not constrain replies to these tools and this choice (None: it can): a bad name, a
    schema that is not a JSON schema or that the grammar library cannot compile, a choice naming no tool."""
    try:
        specs = tool_specs(defs)
        thinker.check_tools(specs, tool_choice(choice))
    except ToolSchemaError as e:
        return str(e)
    return None
