"""Function tools for the thinker, in one place: what a tool is, how a model's template lists tools and writes a
call, how a call is read back out of a reply, and the grammar that keeps a call valid for its tool's schema.

* :class:`ToolSpec` is one function tool (name, description, JSON-schema parameters); :meth:`ToolSpec.parse`
  reads both OpenAI shapes (chat completions' ``{"type": "function", "function": {...}}`` and Realtime's flat
  ``{"type": "function", "name": ...}``). :class:`ToolChoice` is ``auto`` / ``none`` / ``required`` / one named
  function (:meth:`ToolChoice.parse` reads OpenAI's values). :class:`ToolCall` is a finished call.
* :class:`ToolCallFormat` is a model family's tool format, as data: the text its template adds to the system
  message to list the tools, the text around one call, and the wrapper of a tool's result message.
  :data:`TOOL_FORMATS` names the supported ones (``hermes``: Hermes / Qwen2.5's ``<tool_call>`` JSON;
  ``smollm2``: SmolLM2's own, a one-element JSON list in ``<tool_call>[...]</tool_call>``);
  :func:`detect_tool_format` picks one from a tokenizer's chat template. A new format is one more entry.
* :func:`grammar_spec` is the call grammar as an xgrammar *structural tag* (JSON): with ``auto`` the reply is free
  text until the format's trigger (``<tool_call>``), then exactly ``{"name": <one of the tools>, "arguments":
  <that tool's schema>}`` and the closer, then the reply ends; ``required`` and a named function start in the call
  at the first token; ``none`` is free text that never contains the trigger. The torch backend compiles it with
  xgrammar (tool_grammar.py); the vLLM backend hands the same JSON to vLLM's structured outputs, whose default
  backend is xgrammar too, so both backends constrain a reply with the same grammar.
* :class:`ToolReplyState` follows one reply: what may be said aloud (never the call, nor a prefix of the trigger
  that may become one) and, at the end, the call parsed from the reply's text.

docs/architecture.md (Thinker backends, Tool calls) describes the flow.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ThinkerError

ToolChoiceMode = Literal["auto", "none", "required", "function"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolSchemaError(ThinkerError, ValueError):
    """A tool definition or tool choice the thinker cannot use: a bad name, a parameters schema that is not a valid
    JSON schema or that the grammar library cannot compile, a tool choice naming no tool. Raised when the tools are
    set (``session.update``, a request), never in the middle of a reply."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function tool. ``parameters`` is the JSON schema of its arguments (an object schema)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ToolSchemaError(f"tool name {self.name!r}: 1-64 letters, digits, '_' or '-'")
        if not isinstance(self.parameters, Mapping):
            raise ToolSchemaError(f"tool {self.name!r}: parameters must be a JSON schema object")
        check_schema(self.name, self.parameters)

    @classmethod
    def parse(cls, obj: Mapping[str, Any]) -> ToolSpec:
        """An OpenAI function tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``
        (chat completions) or the same keys flat (Realtime)."""
        if obj.get("type", "function") != "function":
            raise ToolSchemaError(f"only function tools are supported, not {obj.get('type')!r}")
        fn = obj.get("function", obj)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ToolSchemaError("a function tool needs a name")
        params = fn.get("parameters")
        return cls(
            fn["name"],
            str(fn.get("description") or ""),
            dict(params) if params is not None else {"type": "object", "properties": {}},
        )

    def openai(self) -> dict[str, Any]:
        """The chat-completions shape, as templates list tools."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


def check_schema(name: str, schema: Mapping[str, Any]) -> None:
    """Refuse a parameters schema that is not a JSON schema (by its own metaschema, via ``jsonschema``)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ToolSchemaError(
            f"tool {name!r}: its parameters are not a valid JSON schema: {e.message}"
        ) from e


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether a reply may (``auto``), may not (``none``) or must (``required``) call a tool, or must call the
    function ``name`` (``function``)."""

    mode: ToolChoiceMode = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode == "function") != (self.name is not None):
            raise ToolSchemaError("a tool choice names a function exactly when its mode is 'function'")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> ToolChoice:
        """OpenAI's ``tool_choice``: ``"auto"``, ``"none"``, ``"required"``, ``{"type": "function", "function":
        {"name": ...}}`` or ``{"type": "function", "name": ...}``; None is ``auto``."""
        if value is None:
            return cls()
        if isinstance(value, str):
            if value not in ("auto", "none", "required"):
                raise ToolSchemaError(
                    f"tool_choice must be auto, none, required or a function, not {value!r}"
                )
            return cls(value)  # type: ignore[arg-type]  # checked just above
        fn = value.get("function", value)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise ToolSchemaError(f"tool_choice {dict(value)!r}: expected a function with a name")
        return cls("function", name)

    def check(self, tools: Sequence[ToolSpec]) -> None:
        if self.mode == "function" and self.name not in {t.name for t in tools}:
            raise ToolSchemaError(f"tool_choice names {self.name!r}, which is not one of the session's tools")
        if self.mode in ("required", "function") and not tools:
            raise ToolSchemaError(f"tool_choice {self.mode!r} needs at least one tool")


TOOL_CHOICE_AUTO = ToolChoice("auto")
TOOL_CHOICE_NONE = ToolChoice("none")
TOOL_CHOICE_REQUIRED = ToolChoice("required")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A finished call: the function's name and its arguments as the JSON text the model wrote (always valid for
    the tool's schema: the grammar allowed nothing else). ``call_id`` names the call for its result."""

    call_id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> dict[str, Any]:
        args = json.loads(self.arguments)
        assert isinstance(args, dict)  # the grammar admits an object only
        return args


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# ------------------------------------------------------------------------------------------- formats
@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """How one model family's chat template lists tools, writes a call and wraps a tool's result.

    The system message gets ``system_block`` after the instructions, with ``{tools}`` replaced by the tools in
    the chat-completions shape (``tools_as_list``: one JSON list; else one JSON object per line). A call is
    ``call_begin + {"name": "<name>", "arguments": <arguments>} + call_end``; ``trigger`` (a prefix of
    ``call_begin``) is where free text turns into a call. A tool's result is a message of ``result_role`` whose
    content is ``result_prefix + result_text(result) + result_suffix``: with ``plain_results`` a JSON object result
    is written as ``key: value; ...`` first (:meth:`result_text`)."""

    name: str
    system_block: str
    tools_as_list: bool
    trigger: str
    call_begin: str
    call_end: str
    result_role: Literal["user"] = "user"
    result_prefix: str = "<tool_response>\n"
    result_suffix: str = "\n</tool_response>"
    plain_results: bool = False

    def __post_init__(self) -> None:
        if not self.call_begin.startswith(self.trigger) or "{tools}" not in self.system_block:
            raise ValueError(f"tool format {self.name!r}: call_begin must start with the trigger")

    def result_text(self, result: str) -> str:
        """A tool's result as the model reads it: as given, or with ``plain_results`` a JSON object as ``key:
        value; ...`` (keys' underscores as spaces; other values as compact JSON), which a small model says back
        where it would read JSON out loud."""
        if not self.plain_results:
            return result
        try:
            obj = json.loads(result)
        except ValueError:
            return result
        if not isinstance(obj, dict):
            return result
        parts = []
        for key, value in obj.items():
            shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            parts.append(f"{str(key).replace('_', ' ')}: {shown}")
        return "; ".join(parts)

    def render_tools(self, tools: Sequence[ToolSpec]) -> str:
        """The text the system message ends with ("" without tools)."""
        if not tools:
            return ""
        items = [t.openai() for t in tools]
        listed = json.dumps(items) if self.tools_as_list else "\n".join(json.dumps(i) for i in items)
        return self.system_block.replace("{tools}", listed)

    def call_head(self, name: str) -> str:
        """Everything of a call before its arguments."""
        return f'{self.call_begin}{{"name": {json.dumps(name)}, "arguments": '

    @property
    def call_tail(self) -> str:
        return "}" + self.call_end

    def render_call(self, call: ToolCall) -> str:
        """A call as the assistant writes it (for an assistant message of the history that made a call)."""
        return self.call_head(call.name) + call.arguments + self.call_tail

    def parse_call(self, text: str) -> ToolCall | None:
        """The first call in a reply's text, or None (no call, or one cut short)."""
        begin = text.find(self.call_begin)
        if begin < 0:
            return None
        end = text.find(self.call_end, begin + len(self.call_begin))
        if end < 0:
            return None
        try:
            body = json.loads(text[begin + len(self.call_begin) : end])
        except json.JSONDecodeError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        args = body.get("arguments", {})
        return ToolCall(new_call_id(), body["name"], json.dumps(args, ensure_ascii=False))


_HERMES_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
#: SmolLM2's function-calling prompt (the SmolLM2-1.7B-Instruct model card; Ollama's smollm2 template renders the
#: same), after the instructions.
_SMOLLM2_BLOCK = (
    "\n\nYou are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out and refuse to answer.\n"
    "If the given question lacks the parameters required by the function, also point it out.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
    "The example format is as follows. Please make sure the parameter type is correct.\n"
    "<tool_call>[\n"
    '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}}\n'
    "]</tool_call>"
)

TOOL_FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(
        name="hermes",
        system_block=_HERMES_BLOCK,
        tools_as_list=False,
        trigger="<tool_call>",
        call_begin="<tool_call>\n",
        call_end="\n</tool_call>",
    ),
    "smollm2": ToolCallFormat(
        name="smollm2",
        system_block=_SMOLLM2_BLOCK,
        tools_as_list=True,
        trigger="<tool_call>",
        call_begin="<tool_call>[\n",
        call_end="\n]</tool_call>",
        # SmolLM2's card shows no tool result. Wrapped in <tool_response> tags, SmolLM2-135M read them back or
        # talked about them ("That's a great example of how to use the tool_response function."); told what it
        # is, and with JSON as plain "key: value" text, it says the result ("The weather in Paris is sunny."):
        # docs/speech-stack.md, Tool calls.
        result_prefix="Tool result: ",
        result_suffix="\nTell me the result.",
        plain_results=True,
    ),
}


def detect_tool_format(chat_template: str | None) -> ToolCallFormat:
    """The format a tokenizer's chat template uses: Hermes/Qwen when the template itself renders tools with
    ``<tool_call>``, else SmolLM2's (whose template renders no tools; the format is its model card's)."""
    if chat_template and "<tool_call>" in chat_template and "tools" in chat_template:
        return TOOL_FORMATS["hermes"]
    return TOOL_FORMATS["smollm2"]


def tool_format(name: str, chat_template: str | None) -> ToolCallFormat:
    """``auto`` (detected from the template) or a name of :data:`TOOL_FORMATS`."""
    if name == "auto":
        return detect_tool_format(chat_template)
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool format {name!r}; known: auto, {', '.join(sorted(TOOL_FORMATS))}"
        ) from None


# ------------------------------------------------------------------------------------------- spoken values
#: Punctuation a spoken span does not start or end with ("Paris," -> "Paris", "4417?" -> "4417").
_SPAN_EDGES = ".,;:!?\"'()[]{}<>«»“”‘’…-"


#: A thousands separator inside a number ("5,512"): the recogniser's formatting, not something the caller said.
_DIGIT_GROUP_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def spoken_spans(text: str, max_words: int = 6) -> list[str]:
    """Every run of up to ``max_words`` consecutive words of ``text``, without the punctuation at its ends, in
    order of first appearance: the values a caller's message can give an argument ("Paris", "order 4417",
    "December 12th", "New Year's Eve"). Numbers are read without thousands separators: whisper writes the order
    number "5512" that a caller says as "5,512"."""
    words = _DIGIT_GROUP_COMMA.sub("", text).split()
    out: dict[str, None] = {}
    for i in range(len(words)):
        for j in range(i + 1, min(len(words), i + max_words) + 1):
            span = " ".join(words[i:j]).strip(_SPAN_EDGES)
            if span:
                out.setdefault(span, None)
    return list(out)


def spoken_schema(schema: Mapping[str, Any], spans: Sequence[str]) -> dict[str, Any]:
    """``schema`` with every free string (a string schema with no ``enum``, ``const``, ``pattern`` or ``format``:
    in object properties, array items, at any depth) made one of ``spans``. Strings the schema already
    constrains, and every other type, are left as they are."""
    out = dict(schema)
    if spans and out.get("type") == "string" and not {"enum", "const", "pattern", "format"} & out.keys():
        low, high = int(out.get("minLength", 0)), out.get("maxLength")
        fits = [s for s in spans if len(s) >= low and (high is None or len(s) <= int(high))]
        if fits:
            out["enum"] = fits
        return out
    props = out.get("properties")
    if isinstance(props, Mapping):
        out["properties"] = {
            k: spoken_schema(v, spans) if isinstance(v, Mapping) else v for k, v in props.items()
        }
    items = out.get("items")
    if isinstance(items, Mapping):
        out["items"] = spoken_schema(items, spans)
    return out


# ------------------------------------------------------------------------------------------- the grammar
def grammar_spec(
    fmt: ToolCallFormat, tools: Sequence[ToolSpec], choice: ToolChoice, *, spoken: str | None = None
) -> str | None:
    """The reply's grammar as an xgrammar structural tag (JSON text), or None when a reply is unconstrained (no
    tools). See the module docstring for what each choice allows. ``spoken``: the caller's message a call's free
    strings must be taken from (:func:`spoken_schema`; ``LogBackedThinker.spoken_arguments``)."""
    if not tools:
        return None
    choice.check(tools)
    spans = spoken_spans(spoken) if spoken else []
    if choice.mode == "none":
        return json.dumps(
            {"type": "structural_tag", "format": {"type": "any_text", "excludes": [fmt.trigger]}}
        )
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    tags = [
        {
            "type": "tag",
            "begin": fmt.call_head(t.name),
            # At most one whitespace character in a row: compact JSON as models write it, and no run of blanks.
            "content": {
                "type": "json_schema",
                "json_schema": spoken_schema(t.parameters, spans) if spans else dict(t.parameters),
                "max_whitespace_cnt": 1,
            },
            "end": fmt.call_tail,
        }
        for t in chosen
    ]
    body: dict[str, Any]
    if choice.mode == "auto":
        body = {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "tags": tags,
            "stop_after_first": True,
        }
    else:
        body = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    return json.dumps({"type": "structural_tag", "format": body})


# ------------------------------------------------------------------------------------------- one reply
@dataclass(slots=True)
class ToolReplyState:
    """What a reply with tools has said aloud and whether it has opened a call."""

    fmt: ToolCallFormat
    choice: ToolChoice
    #: Text of the reply handed out so far (the caller hears this; never any of the call).
    spoken: str = ""
    #: Generated tokens when the call opened (None: no call yet).
    call_token_start: int | None = None
    #: The call's free strings are runs of the caller's words (``grammar_spec(spoken=...)``).
    arguments_from_words: bool = False

    @property
    def in_call(self) -> bool:
        return self.call_token_start is not None

    def speakable(self, text: str, tokens: int, *, final: bool = False) -> str:
        """Of the reply's whole ``text`` so far, what is new to say: up to the trigger, holding back a tail that
        may be the trigger's beginning (unless ``final``). ``tokens``: how many the reply has generated."""
        if self.choice.mode in ("required", "function"):
            self.call_token_start = self.call_token_start if self.in_call else 0
            return ""
        cut = text.find(self.fmt.trigger)
        if cut >= 0:
            if not self.in_call:
                self.call_token_start = tokens
            safe = text[:cut]
        elif final:
            safe = text
        else:
            safe = text
            for k in range(min(len(self.fmt.trigger) - 1, len(text)), 0, -1):
                if self.fmt.trigger.startswith(text[-k:]):
                    safe = text[:-k]
                    break
        if len(safe) <= len(self.spoken):
            return ""
        new = safe[len(self.spoken) :]
        self.spoken = safe
        return new

    def call(self, text: str) -> ToolCall | None:
        return self.fmt.parse_call(text) if self.choice.mode != "none" else None
