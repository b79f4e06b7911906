"""Function tools as the dialects receive them, read into the engine's types in one place.

Both OpenAI shapes of a function tool are read: chat completions' ``{"type": "function", "function": {name,
description, parameters}}`` and Realtime's (and the Responses API's) flat ``{"type": "function", name, description,
parameters}``. What can be checked without the model is checked here (the shape, the name, that the parameters are
an object); whether the grammar library can compile a schema only the engine knows, and it refuses those with
``invalid_tools`` (:func:`engine_refusal` turns that into the dialect's error).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from engine_bridge import protocol as p
from engine_bridge.control import EngineRequestError
from livekit_omni.sessions.errors import WireError

#: OpenAI's limit on a function name.
_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: Tools one session or request may list (OpenAI allows 128).
MAX_TOOLS: Final = 128
EMPTY_PARAMETERS: Final[dict[str, Any]] = {"type": "object", "properties": {}}


def tool_defs(raw: object, param: str) -> list[p.ToolDef]:
    """A ``tools`` list read into the engine's tools; :class:`WireError` (``invalid_value``, naming the
    ``param``) for anything that is not a list of function tools with unique, valid names and object parameters."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise WireError("invalid_type", f"'{param}' must be an array of tools", param=param)
    if len(raw) > MAX_TOOLS:
        raise WireError("invalid_value", f"'{param}' holds at most {MAX_TOOLS} tools", param=param)
    tools: list[p.ToolDef] = []
    for i, obj in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(obj, Mapping):
            raise WireError("invalid_type", f"'{where}' must be an object", param=where)
        kind = obj.get("type", "function")
        if kind != "function":
            raise WireError(
                "invalid_value",
                f"'{where}.type' {kind!r} is not supported: only function tools are called",
                param=f"{where}.type",
            )
        fn = obj.get("function", obj)
        if not isinstance(fn, Mapping):
            raise WireError(
                "invalid_type", f"'{where}.function' must be an object", param=f"{where}.function"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise WireError(
                "invalid_value",
                f"'{where}.name' must be 1-64 letters, digits, '_' or '-'",
                param=f"{where}.name",
            )
        params = fn.get("parameters")
        if params is None:
            params = EMPTY_PARAMETERS
        if not isinstance(params, Mapping):
            raise WireError(
                "invalid_type",
                f"'{where}.parameters' must be a JSON schema object",
                param=f"{where}.parameters",
            )
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise WireError(
                "invalid_type", f"'{where}.description' must be a string", param=f"{where}.description"
            )
        tools.append(p.ToolDef(name=name, description=description, parameters=dict(params)))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise WireError("invalid_value", f"'{param}': tool names must be unique", param=param)
    return tools


def tool_choice_spec(raw: object, param: str) -> p.ToolChoiceSpec:
    """A ``tool_choice`` (``"auto"``, ``"none"``, ``"required"``, ``{"type": "function", "name"}`` or
    ``{"type": "function", "function": {"name"}}``; None: ``auto``) read into the engine's."""
    if raw is None:
        return p.ToolChoiceSpec()
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise WireError(
                "invalid_value", f"'{param}' is auto, none, required or a function, not {raw!r}", param=param
            )
        return p.ToolChoiceSpec(mode=raw)  # type: ignore[arg-type]  # checked just above
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        fn = raw.get("function", raw)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if isinstance(name, str) and name:
            return p.ToolChoiceSpec(mode="function", name=name)
    raise WireError("invalid_value", f"'{param}' names a function as {{type: function, name}}", param=param)


def engine_refusal(e: EngineRequestError, param: str) -> WireError | None:
    """The dialect's error for the engine refusing tools (None: the refusal was about something else)."""
    if e.code != p.ErrorCode.INVALID_TOOLS:
        return None
    return WireError("invalid_value", f"'{param}' refused: {e.message}", param=param)
