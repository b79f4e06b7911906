"""OpenAI ``POST /v1/chat/completions`` answered by the engine's thinker (the same weights as the voice sessions).

This process does no model work: a request is validated here, sent to the engine as a StartText command over the
control channel (:meth:`engine_bridge.client.EngineClient.start_text`), and its tokens come back as TextDelta
events, which become a ``chat.completion`` body or server-sent ``chat.completion.chunk`` events ending in
``data: [DONE]``. A client that goes away mid-stream aborts the request in the engine (its KV is freed at once).

What is accepted and what is refused (400, OpenAI's error shape) is listed in docs/protocol.md, Chat completions;
:func:`parse_request` is the one place that decides it. Engine refusals map to statuses in :data:`ENGINE_ERRORS`.

Function tools: ``tools`` and ``tool_choice`` are read with the engine's own tool types
(``engine_bridge.thinker.tools``: no model library) and sent with the request; the engine compiles their grammar
and refuses what it cannot constrain a call to (``invalid_tools``, a 400). A reply that ends in a call comes back
as ``message.tool_calls`` (streamed: ``delta.tool_calls``, its id and name, then its arguments) with
``finish_reason: "tool_calls"``; the call's text is never in ``content``. One call per reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from engine_bridge import protocol as p
from engine_bridge.client import TextStream
from engine_bridge.control import EngineLostError, EngineRequestError, RequestTimeout
from engine_bridge.thinker.tools import ToolChoice, ToolSchemaError, ToolSpec
from livekit_omni.sessions.hub import hub_of
from livekit_omni.supervisor import EngineUnavailableError

log = logging.getLogger(__name__)

#: How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S: Final = 0.25
#: OpenAI's limit on stop sequences.
MAX_STOP: Final = 4
ROLES: Final = ("system", "developer", "user", "assistant", "tool")


class ChatError(Exception):
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ChatError:
    return ChatError(400, message, param=param, code=code)


#: Engine error code → (HTTP status, OpenAI error type, OpenAI error code).
ENGINE_ERRORS: Final[dict[str, tuple[int, str, str | None]]] = {
    p.ErrorCode.CAPACITY_EXCEEDED: (429, "requests", "rate_limit_exceeded"),
    p.ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "context_length_exceeded"),
    p.ErrorCode.INVALID_REQUEST: (400, "invalid_request_error", None),
    p.ErrorCode.UNSUPPORTED: (400, "invalid_request_error", "text_completions_unsupported"),
    p.ErrorCode.ENGINE_LOADING: (503, "server_error", "engine_unavailable"),
    p.ErrorCode.INVALID_TOOLS: (400, "invalid_request_error", "invalid_tools"),
}
#: The request parameter an engine refusal is about.
ENGINE_ERROR_PARAMS: Final[dict[str, str]] = {
    p.ErrorCode.CONTEXT_LENGTH_EXCEEDED: "messages",
    p.ErrorCode.INVALID_TOOLS: "tools",
}


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[p.TextMessage]
    sampling: p.TextSampling
    stream: bool
    include_usage: bool
    tools: list[p.ToolDef]
    tool_choice: p.ToolChoiceSpec


# --- validation ---------------------------------------------------------------------------------------------------


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise invalid(f"'{key}' must be a number, got {type(v).__name__}", key, "invalid_type")
    if not lo <= v <= hi:
        raise invalid(f"'{key}' must be within [{lo}, {hi}], got {v}", key, "invalid_value")
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if v < lo:
        raise invalid(f"'{key}' must be at least {lo}, got {v}", key, "invalid_value")
    return v


def _content(msg: dict[str, Any], i: int) -> str:
    param = f"messages[{i}].content"
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            return ""  # a message that only made calls
        raise invalid(f"'{param}' is required", param, "missing_required_parameter")
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise invalid(
                    f"'{param}[{j}]' must be an object with a 'type'", f"{param}[{j}]", "invalid_type"
                )
            if part["type"] != "text":
                raise invalid(
                    f"content part type {part['type']!r} is not supported (text only)",
                    f"{param}[{j}].type",
                    "unsupported_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(f"'{param}[{j}].text' must be a string", f"{param}[{j}].text", "invalid_type")
            parts.append(text)
        return "".join(parts)
    raise invalid(f"'{param}' must be a string or a list of text parts", param, "invalid_type")


def _tool_calls(msg: dict[str, Any], i: int) -> list[p.ToolCallItem]:
    """An assistant message's ``tool_calls``: function calls, each ``{"id", "type": "function", "function":
    {"name", "arguments"}}``."""
    param = f"messages[{i}].tool_calls"
    raw = msg.get("tool_calls")
    if raw is None or raw == []:
        return []
    if msg.get("role") != "assistant":
        raise invalid(f"'{param}': only assistant messages carry tool calls", param, "invalid_value")
    if not isinstance(raw, list):
        raise invalid(f"'{param}' must be an array", param, "invalid_type")
    calls: list[p.ToolCallItem] = []
    for j, call in enumerate(raw):
        at = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise invalid(f"'{at}' must be an object", at, "invalid_type")
        if call.get("type", "function") != "function":
            raise invalid(
                f"tool call type {call.get('type')!r} is not supported (function calls only)",
                f"{at}.type",
                "unsupported_value",
            )
        fn = call.get("function")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"'{at}.id' must be a non-empty string", f"{at}.id", "invalid_type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(
                f"'{at}.function.name' must be a non-empty string", f"{at}.function.name", "invalid_type"
            )
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            raise invalid(
                f"'{at}.function.arguments' must be a string", f"{at}.function.arguments", "invalid_type"
            )
        calls.append(p.ToolCallItem(call_id=call_id, name=fn["name"], arguments=arguments or "{}"))
    return calls


def _messages(body: dict[str, Any]) -> list[p.TextMessage]:
    if "messages" not in body or body["messages"] is None:
        raise invalid("'messages' is required", "messages", "missing_required_parameter")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise invalid(f"'messages' must be an array, got {type(raw).__name__}", "messages", "invalid_type")
    if not raw:
        raise invalid("'messages' must contain at least one message", "messages", "empty_array")
    out: list[p.TextMessage] = []
    call_ids: set[str] = set()
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise invalid(f"'messages[{i}]' must be an object", f"messages[{i}]", "invalid_type")
        role = msg.get("role")
        if role == "function":
            raise invalid(
                "'function' messages (the deprecated function calling) are not supported: use tools and 'tool' "
                "messages",
                f"messages[{i}].role",
                "unsupported_value",
            )
        if role not in ROLES:
            raise invalid(
                f"'messages[{i}].role' must be one of {list(ROLES)}, got {role!r}",
                f"messages[{i}].role",
                "invalid_value",
            )
        calls = _tool_calls(msg, i)
        call_ids.update(c.call_id for c in calls)
        tool_call_id = ""
        if role == "tool":
            answers = msg.get("tool_call_id")
            param = f"messages[{i}].tool_call_id"
            if not isinstance(answers, str) or not answers:
                raise invalid(
                    f"'{param}' is required (the id of the call it answers)", param, "invalid_value"
                )
            if answers not in call_ids:
                raise invalid(
                    f"a 'tool' message must answer a call of an earlier assistant message's 'tool_calls'; "
                    f"no call has the id {answers!r}",
                    param,
                    "invalid_value",
                )
            tool_call_id = answers
        out.append(
            p.TextMessage(role=role, text=_content(msg, i), tool_calls=calls, tool_call_id=tool_call_id)
        )
    return out


def _tools(body: dict[str, Any]) -> tuple[list[p.ToolDef], p.ToolChoiceSpec]:
    """``tools`` (function tools only), ``tool_choice`` and ``parallel_tool_calls``, checked as far as the serving
    side can: the engine compiles the tools' grammar and refuses a schema it cannot constrain a call to."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        key = "functions" if body.get("functions") is not None else "function_call"
        raise invalid(
            f"'{key}' (the deprecated function calling) is not supported: use 'tools' and 'tool_choice'",
            key,
            "unsupported_value",
        )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise invalid(f"'tools' must be an array, got {type(raw).__name__}", "tools", "invalid_type")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(f"'{at}' must be an object", at, "invalid_type")
        if tool.get("type") != "function":
            raise invalid(
                f"tool type {tool.get('type')!r} is not supported: only function tools "
                "({'type': 'function', 'function': {...}})",
                f"{at}.type",
                "unsupported_value",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise invalid(f"'{at}.function' must be an object", f"{at}.function", "invalid_type")
        if not isinstance(fn.get("name"), str):
            raise invalid(f"'{at}.function.name' must be a string", f"{at}.function.name", "invalid_type")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid(
                f"'{at}.function.parameters' must be a JSON schema object",
                f"{at}.function.parameters",
                "invalid_type",
            )
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise invalid(
                f"'{at}.function.description' must be a string", f"{at}.function.description", "invalid_type"
            )
        try:
            specs.append(ToolSpec.parse(tool))
        except ToolSchemaError as e:
            raise invalid(f"{at}: {e}", f"{at}.function", "invalid_tools") from None
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise invalid(f"tool names must be unique, got {names}", "tools", "invalid_tools")
    choice_raw = body.get("tool_choice")
    if choice_raw is not None and not isinstance(choice_raw, str | dict):
        raise invalid("'tool_choice' must be a string or an object", "tool_choice", "invalid_type")
    try:
        choice = ToolChoice.parse(choice_raw)
        choice.check(specs)
    except ToolSchemaError as e:
        raise invalid(f"'tool_choice': {e}", "tool_choice", "invalid_value") from None
    defs = [p.ToolDef(name=t.name, description=t.description, parameters=dict(t.parameters)) for t in specs]
    return defs, p.ToolChoiceSpec(mode=choice.mode, name=choice.name)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """What cannot be honoured gets a 400 naming the parameter; defaults and no-op values pass."""
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise invalid("only n=1 is supported (one thinker reply per request)", "n", "unsupported_value")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise invalid("logprobs are not supported", "logprobs", "unsupported_value")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise invalid(
            "only response_format {'type': 'text'} is supported", "response_format", "unsupported_value"
        )
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("only the text modality is supported", "modalities", "unsupported_value")
    for key in ("audio", "prediction", "web_search_options"):
        if body.get(key) is not None:
            raise invalid(f"'{key}' is not supported", key, "unsupported_value")
    if body.get("logit_bias"):
        raise invalid("logit_bias is not supported", "logit_bias", "unsupported_value")
    for key in ("presence_penalty", "frequency_penalty"):
        _number(body, key, -2.0, 2.0)  # accepted and not applied (docs/protocol.md)


def parse_request(raw: bytes) -> ChatRequest:
    """The request body → a :class:`ChatRequest`, or the :class:`ChatError` (400) that refuses it."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model", "")
    if not isinstance(model, str):
        raise invalid(f"'model' must be a string, got {type(model).__name__}", "model", "invalid_type")
    messages = _messages(body)
    _refuse_unsupported(body)
    tools, tool_choice = _tools(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream", "invalid_type")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
    include_usage = bool((opts or {}).get("include_usage", False))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid("'seed' must be an integer", "seed", "invalid_type")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} sequences", "stop", "invalid_value")
    t = 1.0 if temperature is None else temperature  # OpenAI's default
    tp = 1.0 if top_p is None else top_p
    if tp == 0.0:
        t, tp = 0.0, 1.0  # top_p 0 keeps only the most likely token: greedy
    sampling = p.TextSampling(
        max_tokens=max_tokens,
        temperature=t,
        top_p=tp,
        seed=None if seed is None else int(seed) & 0xFFFFFFFF,
        stop=[s for s in stop if s],
    )
    return ChatRequest(model, messages, sampling, bool(stream), include_usage, tools, tool_choice)


# --- the endpoint -------------------------------------------------------------------------------------------------


def _engine_error(e: Exception) -> ChatError:
    if isinstance(e, EngineRequestError):
        status, type_, code = ENGINE_ERRORS.get(e.code, (500, "server_error", e.code))
        return ChatError(status, str(e), type=type_, param=ENGINE_ERROR_PARAMS.get(e.code), code=code)
    if isinstance(e, RequestTimeout):
        return ChatError(
            503, "the engine did not admit the request in time", type="server_error", code="timeout"
        )
    return ChatError(503, f"the engine is unavailable: {e}", type="server_error", code="engine_unavailable")


def _usage(done: p.TextDone) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _finish_reason(done: p.TextDone) -> str:
    if done.finish_reason in ("length", "tool_calls"):
        return done.finish_reason
    return "stop"


def _tool_call(call: p.ToolCallItem) -> dict[str, Any]:
    return {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


async def chat_completions(request: Request) -> Response:
    try:
        # In a worker thread: the tools' schemas are checked against their metaschema (jsonschema), work of their
        # size that the event loop must not wait on.
        req = await asyncio.to_thread(parse_request, await request.body())
    except ChatError as e:
        return e.response()
    try:
        # The same hub as the voice sessions: one way to the engine for every way in.
        stream = await hub_of(request.app).start_text(
            req.messages, req.sampling, tools=req.tools, tool_choice=req.tool_choice
        )
    except EngineUnavailableError as e:
        return ChatError(503, str(e), type="server_error", code="engine_unavailable").response()
    except (EngineRequestError, EngineLostError, RequestTimeout) as e:
        return _engine_error(e).response()
    started = stream.started
    assert started is not None
    completion_id = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())
    model = started.model or req.model
    if req.stream:
        return StreamingResponse(
            _sse(stream, completion_id, created, model, req.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    collect = asyncio.create_task(_collect(stream))
    try:
        # Nothing is sent before the reply is whole, so a client that gives up is only seen by polling.
        while not (await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                collect.cancel()
                return Response(status_code=499)  # nobody reads it; the finally aborts the request
        text, done = collect.result()
    finally:
        collect.cancel()
        if stream.done is None:
            _abort_soon(stream)
    if done.finish_reason in ("error", "abort"):
        return ChatError(500, done.error or "the request ended early", type="server_error").response()
    said = "".join(text)
    message: dict[str, Any] = {"role": "assistant", "content": said, "refusal": None}
    if done.tool_calls:
        message["content"] = said or None  # a reply that only called says nothing
        message["tool_calls"] = [_tool_call(c) for c in done.tool_calls]
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": _finish_reason(done),
                }
            ],
            "usage": _usage(done),
        }
    )


async def _collect(stream: TextStream) -> tuple[list[str], p.TextDone]:
    text: list[str] = []
    async for ev in stream.iter_events():
        if isinstance(ev, p.TextDelta):
            text.append(ev.text)
        else:
            return text, ev
    raise AssertionError("a text stream ends with its TextDone")


def _abort_soon(stream: TextStream) -> None:
    """Abort in a task of its own: the caller is being cancelled (its client went away)."""
    task = asyncio.get_running_loop().create_task(stream.abort())
    _PENDING_ABORTS.add(task)
    task.add_done_callback(_PENDING_ABORTS.discard)


async def _sse(
    stream: TextStream, completion_id: str, created: int, model: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """The chunks of a streamed completion. When the client disconnects, Starlette cancels this generator, and
    the ``finally`` aborts the request in the engine."""

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra,
        }
        if include_usage and "usage" not in body:
            body["usage"] = None
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    try:
        yield chunk({"role": "assistant", "content": "", "refusal": None})
        async for ev in stream.iter_events():
            if isinstance(ev, p.TextDelta):
                yield chunk({"content": ev.text})
                continue
            if ev.finish_reason in ("error", "abort"):
                err = ChatError(500, ev.error or "the request ended early", type="server_error")
                yield b"data: " + json.dumps(err.body).encode() + b"\n\n"
                break
            for index, call in enumerate(ev.tool_calls):
                # As OpenAI streams a call: its id, type and name with empty arguments, then the arguments.
                head = {"index": index, "id": call.call_id, "type": "function"}
                yield chunk({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
            yield chunk({}, _finish_reason(ev))
            if include_usage:
                body = json.loads(chunk({})[6:])
                body["choices"] = []
                body["usage"] = _usage(ev)
                yield b"data: " + json.dumps(body).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        if stream.done is None:
            _abort_soon(stream)


#: Abort tasks started from a cancelled stream (kept referenced until they finish).
_PENDING_ABORTS: set[asyncio.Task[None]] = set()


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
    ]
