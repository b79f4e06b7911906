"""An agent's function tools and tool choices, read into what the engine and the Live wire carry.

LiveKit hands a duplex session its tools as ``llm.Tool`` objects (``@function_tool`` functions, raw-schema tools,
provider tools). A function tool's JSON schema comes from LiveKit's own helper, the one GPT-Live uses
(``llm.utils.build_legacy_openai_schema``), and is then read by the same code as the dialects' OpenAI tool shapes
(:func:`livekit_omni.sessions.tools.tool_defs`: names, uniqueness, object parameters). Whether the engine can
constrain a reply to a schema only the engine knows; it refuses those with ``invalid_tools``, and
:func:`tools_refused` turns that into the ``RealtimeError`` the agent sees.

A module of its own because both sessions (and the model's capabilities) build on it and it needs nothing of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from livekit.agents import llm

from engine_bridge import protocol as p
from livekit_omni.plugin.options import TOOL_CHOICE_MODES
from livekit_omni.sessions.errors import WireError
from livekit_omni.sessions.tools import tool_choice_spec, tool_defs

#: The ``RealtimeError`` code of tools (or a tool choice) the engine or the plugin cannot use.
INVALID_TOOLS: Final = "invalid_tools"
#: The tool a ``WireError`` of :func:`tool_defs` is about (its ``param``: ``tools[i]...``).
_INDEX: Final = re.compile(r"^tools\[(\d+)\]")


def tool_schemas(tools: Sequence[llm.Tool]) -> list[dict[str, Any]]:
    """The agent's function tools in OpenAI's flat function shape (``{type, name, description, parameters}``).

    Raises ``llm.RealtimeError`` (``invalid_tools``) for a provider tool (a hosted search, say): the engine's model
    runs on this machine and can call only functions the agent executes."""
    schemas: list[dict[str, Any]] = []
    for tool in tools:
        if isinstance(tool, llm.FunctionTool):
            schemas.append(llm.utils.build_legacy_openai_schema(tool, internally_tagged=True))
        elif isinstance(tool, llm.RawFunctionTool):
            schema = dict(tool.info.raw_schema)
            schema.pop("meta", None)
            schema["type"] = "function"
            schemas.append(schema)
        else:
            raise llm.RealtimeError(
                f"livekit-omni calls function tools only; {type(tool).__name__} {getattr(tool, 'id', tool)!r} "
                "is a provider tool, which no model here can run",
                code=INVALID_TOOLS,
            )
    return schemas


def engine_tools(tools: Sequence[llm.Tool]) -> list[p.ToolDef]:
    """The agent's tools as the engine's tool definitions (the order kept); ``llm.RealtimeError``
    (``invalid_tools``) naming the tool for one the plugin can already tell is unusable."""
    try:
        return tool_defs(tool_schemas(tools), "tools")
    except WireError as e:
        where = _INDEX.match(e.param or "")
        which = (
            f"tool {tools[int(where.group(1))].id!r}"
            if where and int(where.group(1)) < len(tools)
            else f"tools {[t.id for t in tools]}"
        )
        raise llm.RealtimeError(
            f"livekit-omni cannot use the agent's {which}: {e.message}", code=INVALID_TOOLS
        ) from None


def choice_spec(choice: llm.ToolChoice | str) -> p.ToolChoiceSpec:
    """LiveKit's tool choice (``"auto"``, ``"none"``, ``"required"``, ``{"type": "function", "function": {"name"}}``)
    or the plugin option's (the same three, or a bare function name) as the engine's."""
    if isinstance(choice, str) and choice not in TOOL_CHOICE_MODES:
        return p.ToolChoiceSpec(mode="function", name=choice)
    try:
        return tool_choice_spec(choice, "tool_choice")
    except WireError as e:
        raise llm.RealtimeError(f"livekit-omni: {e.message}", code=INVALID_TOOLS) from None


def responses_tool_choice(spec: p.ToolChoiceSpec) -> str | dict[str, str]:
    """The engine's tool choice in the Responses API's shape (what a Live ``delegation.responses`` carries)."""
    if spec.mode == "function" and spec.name:
        return {"type": "function", "name": spec.name}
    return spec.mode


def responses_tools(tools: Sequence[p.ToolDef]) -> list[dict[str, Any]]:
    """The engine's tool definitions as Responses function tools (what a Live ``delegation.responses`` carries)."""
    return [
        {"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
        for t in tools
    ]


def tools_refused(detail: str, tools: Sequence[p.ToolDef]) -> llm.RealtimeError:
    """The error for tools the engine (or server) refused: its reason, and the agent's tools by name."""
    names = [t.name for t in tools]
    return llm.RealtimeError(
        f"livekit-omni: the engine cannot use the agent's tools {names}: {detail}", code=INVALID_TOOLS
    )
