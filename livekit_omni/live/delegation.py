"""Delegation on the Live dialect: the engine's own thinker as the Responses backend, and tasks handed to the app.

The Live protocol hands tool work off the voice model: to a Responses backend (``responses`` delegation, LiveKit
``GPTLiveModel``'s default) or to the application (``client``). Here one model does both: the engine's thinker speaks
and calls, so a "delegation" is a reply that ended in a function call (``ReplyDone.tool_calls``). This module reads
the delegation's settings into the engine's (:func:`responses_tools`, :func:`client_tools`, :func:`engine_instructions`)
and writes the backend's stream as the Live protocol carries it (:class:`BackendResponse`); the session
(livekit_omni.live.session) keeps the state and talks to the engine.

* ``responses``: the function tools of ``responses.tools`` and ``responses.tool_choice`` are the engine session's
  (other tool types are not served: a non-fatal ``error`` names them), ``responses.instructions`` follow the voice
  instructions in the engine's system prompt. A reply that calls is a delegation: ``session.delegation.created``,
  then the backend response's stream in ``response.event`` envelopes (created, the call's item and arguments,
  completed). The client's ``function_call_output`` is the call's result in the engine's conversation, and its
  ``response.create`` a spoken continuation, framed by a response of its own under the same delegation.
* ``client``: the engine session gets one built-in tool, :data:`DELEGATE_TOOL`; a reply that calls it is a
  delegation to the application (``session.delegation.created`` with target ``client``), whose commentary (or
  thinking) carrying that ``delegation_id`` is its answer. The engine's call is closed (:data:`HANDED_OVER`) when
  the application first answers, so the engine's automatic acknowledgement still plays if the app is slow.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from engine_bridge import protocol as p
from livekit_omni.live import wire
from livekit_omni.sessions.errors import WireError
from livekit_omni.sessions.tools import MAX_TOOLS, tool_choice_spec, tool_defs

RESPONSES_PARAM: Final = "session.delegation.responses"

#: The one tool a ``client`` delegation gives the engine session: calling it hands the caller's task to the app.
DELEGATE_TOOL: Final = p.ToolDef(
    name="delegate_to_app",
    description=(
        "Hand the caller's request to the application. Call this when the caller asks you to do something "
        "(book, order, send, change a setting) or asks for information you cannot know yourself (today's "
        "weather, the news, an account, an order's status). The application answers later."
    ),
    parameters={
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "What the application should do or find out."}
        },
        "required": ["task"],
    },
)
#: The result that closes the engine's call of :data:`DELEGATE_TOOL` once the application answers.
HANDED_OVER: Final = "The application took the task; its answer follows."


@dataclass(frozen=True, slots=True)
class EngineTools:
    """A delegation's tools as the engine session takes them."""

    tools: list[p.ToolDef] = field(default_factory=list)
    choice: p.ToolChoiceSpec = field(default_factory=p.ToolChoiceSpec)
    #: The raw tools that are served (the echo of ``responses.tools``); None: not a responses delegation.
    served: list[Any] | None = None
    #: Tools that are not served (a non-function tool, an engine without tools): a non-fatal error for the client.
    refused: WireError | None = None


def responses_tools(responses: Mapping[str, Any], *, engine_runs_tools: bool) -> EngineTools:
    """``responses.tools`` and ``responses.tool_choice`` read into the engine's. Function tools are served; other
    tool types (hosted, MCP, custom) are left out with ``refused`` naming the first; a malformed function tool or
    choice raises :class:`WireError` (``invalid_value``/``invalid_type``, the param named)."""
    raw = responses.get("tools")
    param = f"{RESPONSES_PARAM}.tools"
    if raw is not None and not isinstance(raw, list):
        raise WireError("invalid_type", f"'{param}' must be an array of tools", param=param)
    raw = raw or []
    if len(raw) > MAX_TOOLS:
        raise WireError("invalid_value", f"'{param}' holds at most {MAX_TOOLS} tools", param=param)
    served: list[Any] = []
    defs: list[p.ToolDef] = []
    refused: WireError | None = None
    for i, obj in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(obj, Mapping):
            raise WireError("invalid_type", f"'{where}' must be an object", param=where)
        kind = obj.get("type", "function")
        if kind != "function":
            if refused is None:
                refused = WireError(
                    "invalid_value",
                    f"'{where}.type' {kind!r} is not served: this server's backend calls function tools only, "
                    "so that tool was left out (the others are in use)",
                    param=f"{where}.type",
                )
            continue
        try:
            (tool,) = tool_defs([obj], param)
        except WireError as e:
            at = f"{param}[0]"
            raise WireError(
                e.code,
                e.message.replace(at, where),
                param=(e.param or where).replace(at, where),
            ) from None
        defs.append(tool)
        served.append(obj)
    names = [t.name for t in defs]
    if len(set(names)) != len(names):
        raise WireError("invalid_value", f"'{param}': tool names must be unique", param=param)
    choice = tool_choice_spec(responses.get("tool_choice"), f"{RESPONSES_PARAM}.tool_choice")
    if not engine_runs_tools and (defs or choice.mode in ("required", "function")):
        refused = WireError(
            "invalid_value",
            f"'{param}': this server's engine adapter runs no function tools; the session goes on without them "
            "(and without its tool_choice)",
            param=param,
        )
        defs, served, choice = [], [], p.ToolChoiceSpec()
    return EngineTools(tools=defs, choice=choice, served=served, refused=refused)


def client_tools(d: wire.Delegation, *, delegates: bool, engine_runs_tools: bool) -> EngineTools:
    """A ``client`` delegation's engine tools: :data:`DELEGATE_TOOL` when the session asked for client delegation
    and the engine runs tools, with the extension ``tool_choice`` (``auto`` by default)."""
    if not delegates or not engine_runs_tools:
        return EngineTools()
    mode = d.tool_choice or "auto"
    choice = (
        p.ToolChoiceSpec(mode="function", name=DELEGATE_TOOL.name)
        if mode == "required"
        else p.ToolChoiceSpec(
            mode=mode  # type: ignore[arg-type]  # checked by wire.resolve_delegation: auto or none
        )
    )
    return EngineTools(tools=[DELEGATE_TOOL], choice=choice)


def engine_instructions(voice: str, d: wire.Delegation) -> str:
    """The engine's system prompt: the voice instructions, then (``responses``) the backend's instructions after a
    blank line. Without voice instructions the backend's stand alone (in place of the engine's default prompt)."""
    backend = (d.responses or {}).get("instructions") if d.type == "responses" else None
    if not isinstance(backend, str) or not backend.strip():
        return voice
    return f"{voice.rstrip()}\n\n{backend.strip()}" if voice.strip() else backend.strip()


def continuation_choice(session_choice: p.ToolChoiceSpec) -> p.ToolChoiceSpec:
    """A continuation's tool choice: the session's, except that one forcing a call (``required``, a named
    function) becomes ``auto``, so the answer built on the results can be spoken."""
    if session_choice.mode in ("required", "function"):
        return p.ToolChoiceSpec(mode="auto")
    return session_choice


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage_of(ev: p.ReplyDone) -> wire.ResponsesUsage:
    """A reply's tokens as the Responses usage LiveKit reports under the backend's name."""
    return wire.ResponsesUsage(
        input_tokens=ev.input_tokens,
        input_tokens_details=wire.InputTokensDetails(cached_tokens=ev.cached_tokens),
        output_tokens=ev.output_tokens,
        output_tokens_details=wire.OutputTokensDetails(),
        total_tokens=ev.input_tokens + ev.output_tokens,
    )


def _wire_choice(choice: p.ToolChoiceSpec) -> str | dict[str, Any]:
    if choice.mode == "function":
        return {"type": "function", "name": choice.name or ""}
    return choice.mode


@dataclass(slots=True)
class BackendResponse:
    """One response of the Responses backend: a reply that called (its stream is written at once when the reply
    ends), or a continuation asked for by ``response.create`` (created then, completed when its reply ends)."""

    id: str
    delegation_id: str | None
    model: str
    choice: p.ToolChoiceSpec
    created_at: float = field(default_factory=time.time)
    #: The stream's ``sequence_number`` of the next event.
    seq: int = 0
    #: The calls the response made (``output_index`` is their position).
    calls: int = 0
    #: The engine reply it is bound to (continuations: the first reply to start after ``response.create``).
    reply: tuple[int, int] | None = None

    def _next(self) -> int:
        self.seq += 1
        return self.seq - 1

    def _snapshot(self, status: str, usage: wire.ResponsesUsage | None = None) -> wire.ResponsesResponse:
        done = status != "in_progress"
        return wire.ResponsesResponse(
            id=self.id,
            object="response",
            created_at=self.created_at,
            model=self.model,
            status=status,  # type: ignore[arg-type]  # one of the literal's values
            output=[],
            tools=[],
            tool_choice=_wire_choice(self.choice),
            parallel_tool_calls=False,  # one call per reply
            completed_at=time.time() if done else None,
            usage=usage,
        )

    def created(self) -> wire.ResponsesCreated:
        return wire.ResponsesCreated(sequence_number=self._next(), response=self._snapshot("in_progress"))

    def completed(self, usage: wire.ResponsesUsage) -> wire.ResponsesCompleted:
        return wire.ResponsesCompleted(
            sequence_number=self._next(), response=self._snapshot("completed", usage)
        )

    def call(self, call: p.ToolCallItem) -> list[wire.ResponsesStreamEvent]:
        """A call's events: its item added (in progress), the arguments (one delta: they are generated under the
        tool's grammar, then sent), their done, and the completed item LiveKit runs the tool from."""
        index = self.calls
        self.calls += 1
        item_id = new_id("fc")
        opened = wire.FunctionCallItem(
            id=item_id, call_id=call.call_id, name=call.name, arguments="", status="in_progress"
        )
        done = wire.FunctionCallItem(
            id=item_id, call_id=call.call_id, name=call.name, arguments=call.arguments, status="completed"
        )
        return [
            wire.ResponsesOutputItemAdded(sequence_number=self._next(), output_index=index, item=opened),
            wire.ResponsesFunctionCallArgumentsDelta(
                sequence_number=self._next(), item_id=item_id, output_index=index, delta=call.arguments
            ),
            wire.ResponsesFunctionCallArgumentsDone(
                sequence_number=self._next(), item_id=item_id, output_index=index, arguments=call.arguments
            ),
            wire.ResponsesOutputItemDone(sequence_number=self._next(), output_index=index, item=done),
        ]


@dataclass(slots=True)
class BackendCall:
    """A call of the Responses backend, awaiting (or holding) the client's ``function_call_output``."""

    call_id: str
    #: None: a call of a response the application started (no delegation).
    delegation_id: str | None
    answered: bool = False


def output_text(item: Mapping[str, Any]) -> str:
    """A ``function_call_output``'s ``output``: a string, or a list of ``input_text`` parts (joined)."""
    out = item.get("output")
    if isinstance(out, str):
        return out
    if isinstance(out, list):
        texts: list[str] = []
        for i, part in enumerate(out):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "input_text"
                or not isinstance(part.get("text"), str)
            ):
                raise WireError(
                    "invalid_value",
                    "a function_call_output's output is a string or a list of input_text parts",
                    param=f"item.output[{i}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise WireError(
        "missing_required_parameter" if out is None else "invalid_type",
        "a function_call_output needs an output (a string)",
        param="item.output",
    )


#: A message item's role -> the engine append it becomes.
MESSAGE_KINDS: Final[dict[str, p.AppendKind]] = {
    "user": "user",
    "assistant": "assistant",
    "developer": "thinking",
    "system": "thinking",
}


def message_append(item: Mapping[str, Any]) -> tuple[p.AppendKind, str]:
    """A message item for the backend -> (engine append kind, text)."""
    role = item.get("role")
    if role not in MESSAGE_KINDS:
        raise WireError(
            "invalid_value", "a message's role is user, assistant, developer or system", param="item.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return MESSAGE_KINDS[role], content
    if not isinstance(content, list):
        raise WireError(
            "invalid_type", "a message's content is a string or a list of parts", param="item.content"
        )
    texts: list[str] = []
    for i, part in enumerate(content):
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str):
            raise WireError("invalid_value", "only text parts are taken", param=f"item.content[{i}]")
        texts.append(text)
    return MESSAGE_KINDS[role], " ".join(t for t in texts if t)
