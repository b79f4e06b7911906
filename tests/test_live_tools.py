"""Function tools on the Live dialect: delegation to the Responses backend (the engine's own thinker) and to the
application, against a real server with the embedded models, driven by the openai SDK's ``client.live.connect()``
and by LiveKit's stock ``GPTLiveModel``; every server event of the SDK tests is validated against the SDK's types
(the nested Responses events against ``ResponseStreamEvent``), strictly.

The embedded SmolLM2-135M calls a tool when a reply must (``tool_choice: "required"`` or a named function); which
replies should call under ``auto`` is the thinker's concern, so the call-flow tests force the call. The first tests
need no model: the rules that read a delegation's tools, on the wire and on a server whose engine runs no tools.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import msgspec
import pytest
from livekit.agents import Agent, AgentSession, function_tool
from livekit.plugins.openai.realtime import GPTLiveModel

from engine_bridge import protocol as p
from livekit_omni.live import delegation as dg
from livekit_omni.live import wire
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess, start_server
from tests.live_sdk import API_KEY, INSTRUCTIONS, LiveSdkCaller, live_caller, nested
from tests.plugin_harness import Mic, Speaker, history_messages, wait_until
from tests.speech_fixtures import synthesize_speech

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a given city.",
    "parameters": CITY,
}
ORDER_ARGS = {
    "type": "object",
    "properties": {"order_number": {"type": "integer"}},
    "required": ["order_number"],
}
ORDER = {
    "type": "function",
    "name": "get_order_status",
    "description": "Look up the delivery status of an order by its number.",
    "parameters": ORDER_ARGS,
}
RESULT = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"})
WEATHER_QUESTION = "What is the weather like in Paris today?"
#: What LiveKit's GPTLiveModel sends (as commentary) for a typed message: the dialect's way of sending text.
ASK_TYPED = (
    "Reply to the caller now, don't repeat what they said. Do not wait for the caller to speak first. "
    "After that, pause and listen."
)
#: The nested events of a backend response that made one call, in order.
CALL_STREAM = [
    "response.created",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def responses_delegation(**responses: Any) -> dict[str, Any]:
    return {"delegation": {"type": "responses", "responses": {"model": "gpt-5.6-luna", **responses}}}


# --- the rules, without a model -------------------------------------------------------------------------------


def test_responses_tools_serve_function_tools_and_refuse_the_rest_by_name() -> None:
    tools = dg.responses_tools(
        {"tools": [WEATHER, {"type": "web_search"}, ORDER], "tool_choice": "required"}, engine_runs_tools=True
    )
    assert [t.name for t in tools.tools] == ["get_weather", "get_order_status"]
    assert tools.served == [WEATHER, ORDER] and tools.choice == p.ToolChoiceSpec(mode="required")
    assert tools.refused is not None and tools.refused.code == "invalid_value"
    assert tools.refused.param == "session.delegation.responses.tools[1].type"
    # A malformed function tool is an error naming it where it is in the list.
    with pytest.raises(wire.WireError) as e:
        dg.responses_tools(
            {"tools": [{"type": "web_search"}, {"type": "function", "name": "bad name"}]},
            engine_runs_tools=True,
        )
    assert e.value.param == "session.delegation.responses.tools[1].name", e.value
    with pytest.raises(wire.WireError) as e:
        dg.responses_tools({"tools": [WEATHER, WEATHER]}, engine_runs_tools=True)
    assert "unique" in e.value.message
    with pytest.raises(wire.WireError) as e:
        dg.responses_tools({"tool_choice": {"type": "allowed_tools", "tools": []}}, engine_runs_tools=True)
    assert e.value.param == "session.delegation.responses.tool_choice"
    # An engine that runs no tools: the session goes on without them, and says so.
    none = dg.responses_tools({"tools": [WEATHER], "tool_choice": "required"}, engine_runs_tools=False)
    assert none.tools == [] and none.served == [] and none.choice == p.ToolChoiceSpec()
    assert none.refused is not None and none.refused.param == "session.delegation.responses.tools"


def test_client_delegation_gives_the_engine_its_one_tool_only_when_asked_for() -> None:
    explicit = wire.resolve_config(
        msgspec.convert({"model": "m", "delegation": {"type": "client"}}, wire.StartConfig)
    )
    omitted = wire.resolve_config(msgspec.convert({"model": "m"}, wire.StartConfig))
    assert explicit.delegates_to_client and not omitted.delegates_to_client
    assert (
        explicit.delegation
        == omitted.delegation
        == wire.Delegation(type="client", acknowledgement_delay_ms=0)
    )
    tools = dg.client_tools(explicit.delegation, delegates=True, engine_runs_tools=True)
    assert tools.tools == [dg.DELEGATE_TOOL] and tools.choice == p.ToolChoiceSpec(mode="auto")
    assert dg.client_tools(omitted.delegation, delegates=False, engine_runs_tools=True).tools == []
    assert dg.client_tools(explicit.delegation, delegates=True, engine_runs_tools=False).tools == []
    required = wire.resolve_delegation(wire.Delegation(type="client", tool_choice="required"), current=None)
    assert dg.client_tools(required, delegates=True, engine_runs_tools=True).choice == p.ToolChoiceSpec(
        mode="function", name=dg.DELEGATE_TOOL.name
    )


def test_delegation_settings_are_checked_and_sparse() -> None:
    current = wire.resolve_delegation(
        wire.Delegation(
            type="responses",
            responses={"model": "x", "instructions": "Be exact."},
            acknowledgement_delay_ms=700,
        ),
        current=None,
    )
    new = wire.resolve_delegation(
        wire.Delegation(type="responses", responses={"tools": [WEATHER]}), current=current
    )
    assert new.acknowledgement_delay_ms == 700  # omitted in an update: kept
    assert new.responses == {"model": "x", "instructions": "Be exact.", "tools": [WEATHER]}
    assert dg.engine_instructions("Be brief.", new) == "Be brief.\n\nBe exact."
    assert dg.engine_instructions("", new) == "Be exact."
    for bad, param in (
        (wire.Delegation(type="client", acknowledgement_delay_ms=60_001), "acknowledgement_delay_ms"),
        (wire.Delegation(type="client", tool_choice="sometimes"), "tool_choice"),
        (wire.Delegation(type="responses", tool_choice="required"), "tool_choice"),
        (wire.Delegation(type="responses", responses={"instructions": 5}), "responses.instructions"),
    ):
        with pytest.raises(wire.WireError) as e:
            wire.resolve_delegation(bad, current=None)
        assert e.value.param == f"session.delegation.{param}", e.value
    assert dg.continuation_choice(p.ToolChoiceSpec(mode="required")) == p.ToolChoiceSpec(mode="auto")
    assert dg.continuation_choice(p.ToolChoiceSpec(mode="none")) == p.ToolChoiceSpec(mode="none")


@pytest.fixture(scope="module")
def loopback() -> Iterator[ServerProcess]:
    s = start_server(adapter="loopback", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield s
    s.stop()


async def _error(c: LiveClient, code: str) -> wire.Error:
    ev = await c.next_event(wire.Error)
    assert ev.error.code == code, ev
    return ev


async def test_an_engine_without_tools_starts_the_session_without_them(loopback: ServerProcess) -> None:
    """Stock clients keep working on an engine adapter that runs no tools: the session starts, the tools are left
    out with a non-fatal error naming them; the backend's commands are checked."""
    c = await LiveClient.connect(loopback.url, api_key=API_KEY)
    try:
        ev = await c.start({"model": "m", **responses_delegation(tools=[WEATHER], tool_choice="required")})
        assert isinstance(ev, wire.SessionStarted), ev
        assert ev.session.delegation.responses == {"model": "gpt-5.6-luna", "tools": []}
        err = await _error(c, "invalid_value")
        assert (
            err.error.param == "session.delegation.responses.tools"
            and "no function tools" in err.error.message
        )
        assert err.error.client_event_id == "start"
        # Under responses delegation an append carries no delegation id (results go in response.item.create).
        await c.send({"type": "session.commentary.append", "content": "x", "delegation_id": "del_1"})
        assert (await _error(c, "invalid_value")).error.param == "delegation_id"
        await c.send(
            {
                "type": "response.item.create",
                "event_id": "i1",
                "item": {"type": "function_call_output", "call_id": "call_nope", "output": "42"},
            }
        )
        err = await _error(c, "invalid_value")
        assert err.error.param == "item.call_id" and err.error.client_event_id == "i1"
        await c.send({"type": "response.item.create", "item": {"type": "reasoning", "summary": []}})
        assert (await _error(c, "invalid_value")).error.param == "item.type"
        await c.send(
            {"type": "response.item.create", "item": {"type": "message", "role": "user", "content": 5}}
        )
        assert (await _error(c, "invalid_type")).error.param == "item.content"
        # A user message for the backend is taken without an answer (nothing runs until response.create).
        await c.send(
            {
                "type": "response.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi."}],
                },
            }
        )
        await c.send(
            {"type": "session.update", "event_id": "u", "session": {"delegation": {"type": "responses"}}}
        )
        assert (await c.next_event(wire.SessionUpdated)).client_event_id == "u"
        assert not [e for e in c.events if isinstance(e, wire.Error) and e.client_event_id == "u"]
    finally:
        await c.close()


# --- the Responses backend, over the openai SDK ------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(adapter="cascade", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield s
    s.stop()


async def delegated_call(c: LiveSdkCaller, timeout: float = 60) -> tuple[dict[str, Any], dict[str, Any]]:
    """The next responses delegation and the completed call its backend response made: ``session.delegation.
    created`` then the response's whole stream, in order, under its delegation id (what LiveKit reads)."""
    created = await c.until_type("session.delegation.created", timeout)
    d = created["delegation"]
    assert d["target"] == "responses" and d["type"] == "delegation" and d["response_id"], created
    assert isinstance(created["offset_ms"], int) and created["offset_ms"] > 0
    start = len(c.events)
    await c.until(
        lambda e: nested(e) == "response.completed" and e.get("delegation_id") == d["id"],
        10,
        "response.completed",
    )
    stream = [e for e in c.events[start:] if e["type"] == "response.event"]
    assert [nested(e) for e in stream] == CALL_STREAM, c.types()
    assert all(e["delegation_id"] == d["id"] for e in stream)
    first, last = stream[0]["event"]["response"], stream[-1]["event"]["response"]
    assert first["id"] == last["id"] == d["response_id"]
    assert (first["status"], last["status"]) == ("in_progress", "completed")
    assert last["usage"]["output_tokens"] > 0 and last["output"] == [] and last["tools"] == []
    # The item LiveKit runs the tool from: completed, with call id, name and the arguments as JSON text.
    item = stream[4]["event"]["item"]
    assert item["type"] == "function_call" and item["status"] == "completed", item
    assert item["call_id"] and item["name"] and isinstance(item["arguments"], str)
    assert stream[3]["event"]["arguments"] == stream[2]["event"]["delta"] == item["arguments"]
    return d, item


@pytest.mark.models
async def test_a_spoken_question_is_delegated_and_the_result_is_spoken_as_a_continuation(
    server: ServerProcess,
) -> None:
    """Responses delegation with ``required``: the caller's spoken question ends in a ``get_weather`` call, which
    reaches the client as a delegation and the backend's stream; while it runs the engine acknowledges it
    (``acknowledgement_delay_ms`` 0, Live's default); the client's ``function_call_output`` and ``response.create``
    give a spoken continuation, framed by a response of its own under the same delegation."""
    session = responses_delegation(tools=[WEATHER, ORDER], tool_choice="required")
    async with live_caller(server, session) as c:
        started = c.events[0]["session"]["delegation"]
        assert started["responses"]["tools"] == [WEATHER, ORDER] and started["acknowledgement_delay_ms"] == 0
        c.say(WEATHER_QUESTION)
        d, call = await delegated_call(c)
        assert call["name"] == "get_weather", call
        jsonschema.validate(json.loads(call["arguments"]), CITY)
        after_call = len(c.events)
        await c.until(lambda e: "moment" in c.said(after_call).lower(), 20, "the spoken acknowledgement")

        await c.conn.response.item.create(
            item={"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}
        )
        await c.conn.response.create(event_id="continue")
        created = await c.until(lambda e: nested(e) == "response.created", 20, "the continuation")
        assert created["delegation_id"] == d["id"] and created["client_event_id"] == "continue"
        rid = created["event"]["response"]["id"]
        assert rid != d["response_id"]
        begun = c.events.index(created)
        done = await c.until(
            lambda e: nested(e) == "response.completed" and e["event"]["response"]["id"] == rid, 60, "its end"
        )
        assert done["delegation_id"] == d["id"] and done["event"]["response"]["usage"]["output_tokens"] > 0
        ended = c.events.index(done)
        await c.quiet(2.0, lambda e: False)  # the last words play after the reply's audio left the engine
        assert c.said(begun).strip(), "the continuation is spoken"
        assert "".join(
            e["delta"] for e in c.events[begun:ended] if e["type"] == "session.output_transcript.delta"
        ).strip(), "the continuation is spoken while its response runs"
        between = [nested(e) for e in c.events[begun:ended] if e["type"] == "response.event"]
        assert "response.output_item.done" not in between, "the continuation makes no call"
        assert not [e for e in c.events if e["type"] == "error"], [
            e for e in c.events if e["type"] == "error"
        ]


@pytest.mark.models
async def test_tools_are_refused_by_name_and_a_live_update_changes_them(server: ServerProcess) -> None:
    """A schema the grammar library cannot compile refuses ``session.start`` (close 1008); a hosted tool at start is
    left out (non-fatal ``error`` naming it; the session goes on with the function tools); an uncompilable schema
    and a choice naming no tool are refused at ``session.update`` (nothing changes); LiveKit's sparse update of ``responses.tools`` (and ``tool_choice``) is
    what the next delegation calls, here asked in text as LiveKit sends it."""
    bad_schema = {
        "type": "function",
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}},
    }
    refused = await LiveClient.connect(server.url, api_key=API_KEY)
    try:
        ev = await refused.start({"model": "m", **responses_delegation(tools=[WEATHER, bad_schema])})
        assert isinstance(ev, wire.Error) and ev.error.code == "invalid_value", ev
        assert ev.error.param == "session.delegation.responses.tools" and ev.error.client_event_id == "start"
        assert await refused.wait_closed() == 1008  # a configuration the engine cannot serve
    finally:
        await refused.close()
    async with live_caller(server, responses_delegation(tools=[WEATHER, {"type": "web_search"}])) as c:
        assert c.events[0]["session"]["delegation"]["responses"]["tools"] == [WEATHER]
        err = await c.until_type("error", 10)
        assert err["error"]["code"] == "invalid_value", err
        assert (
            err["error"]["param"] == "session.delegation.responses.tools[1].type"
            and "web_search" in err["error"]["message"]
        )
        for n, (responses, param) in enumerate(
            (
                ({"tools": [bad_schema]}, "session.delegation.responses.tools"),
                (
                    {"tool_choice": {"type": "function", "name": "nope"}},
                    "session.delegation.responses.tool_choice",
                ),
            )
        ):
            await c.conn.session.update(
                session={"delegation": {"type": "responses", "responses": responses}}, event_id=f"bad{n}"
            )
            err = await c.until_type("error", 20)
            assert (err["error"]["code"], err["error"]["param"]) == ("invalid_value", param), err
            assert err["error"]["client_event_id"] == f"bad{n}"
        assert not [e for e in c.events if e["type"] == "session.updated"], "a refused update is not echoed"
        await c.conn.session.update(
            session={
                "delegation": {
                    "type": "responses",
                    "responses": {"tools": [ORDER], "tool_choice": "required"},
                }
            },
            event_id="ok",
        )
        updated = await c.until_type("session.updated", 20)
        assert updated["client_event_id"] == "ok"
        assert updated["session"]["delegation"]["responses"]["tools"] == [ORDER]
        assert updated["session"]["delegation"]["acknowledgement_delay_ms"] == 0  # kept
        await c.conn.session.commentary.append(
            content=f"{ASK_TYPED}\n\nWhere is my order 4417?", delegation_id=None
        )
        _, call = await delegated_call(c)
        assert call["name"] == "get_order_status", call
        jsonschema.validate(json.loads(call["arguments"]), ORDER_ARGS)


@pytest.mark.models
async def test_a_barge_in_while_a_call_is_pending_is_answered_and_the_late_result_is_not_spoken(
    server: ServerProcess,
) -> None:
    """The call reached the client; before its result the caller asks something else (the session's choice now
    ``auto``, a sparse update), which is answered in words without a new delegation; the result that arrives after
    that joins the conversation silently: nothing is said and no backend response runs until the client asks."""
    async with live_caller(server, responses_delegation(tools=[WEATHER], tool_choice="required")) as c:
        c.say(WEATHER_QUESTION)
        _, call = await delegated_call(c)
        await c.conn.session.update(
            session={"delegation": {"type": "responses", "responses": {"tool_choice": "auto"}}},
            event_id="auto",
        )
        updated = await c.until_type("session.updated", 20)
        assert updated["session"]["delegation"]["responses"]["tools"] == [WEATHER]  # sparse: kept
        asked = len(c.events)
        c.say("What is the capital of France?")
        await c.until(
            lambda e: e["type"] == "session.input_transcript.delta" and "france" in e["delta"].lower(),
            40,
            "the caller's question",
        )
        await c.until(lambda e: "paris" in c.said(asked).lower(), 60, "the answer")
        await c.quiet(3.0, lambda e: False)
        assert not [
            e for e in c.events[asked:] if e["type"] in ("session.delegation.created", "response.event")
        ]
        # A response.create now would be refused: the pending call has no output yet.
        await c.conn.response.create(event_id="early")
        err = await c.until_type("error", 10)
        assert (
            err["error"]["code"] == "missing_tool_outputs" and call["call_id"] in err["error"]["message"]
        ), err
        late = len(c.events)
        await c.conn.response.item.create(
            item={"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}
        )
        after = await c.quiet(
            5.0, lambda e: e["type"] in ("session.output_transcript.delta", "response.event", "error")
        )
        assert after == [], after
        assert not c.said(late)


# --- client delegation --------------------------------------------------------------------------------------------


@pytest.mark.models
async def test_client_delegation_hands_the_task_to_the_app_whose_commentary_is_spoken(
    server: ServerProcess,
) -> None:
    """``client`` delegation asked for explicitly (its reply's choice forced with the extension ``tool_choice``):
    the model hands the caller's task to the app (``session.delegation.created``, target ``client``), the engine
    acknowledges it while the app works; an unknown ``delegation_id`` is refused; the app's commentary carrying the
    delegation's id is spoken."""
    async with live_caller(server, {"delegation": {"type": "client", "tool_choice": "required"}}) as c:
        assert c.events[0]["session"]["delegation"] == {
            "type": "client",
            "acknowledgement_delay_ms": 0,
            "tool_choice": "required",
        }
        await c.conn.session.commentary.append(
            content=f"{ASK_TYPED}\n\n{WEATHER_QUESTION}", delegation_id=None
        )
        created = await c.until_type("session.delegation.created", 60)
        d = created["delegation"]
        assert d["target"] == "client" and d["type"] == "delegation" and "response_id" not in d, d
        delegated = len(c.events)
        await c.until(lambda e: "moment" in c.said(delegated).lower(), 20, "the spoken acknowledgement")

        await c.conn.session.commentary.append(
            content="It is sunny.", delegation_id="del_nope", event_id="bad"
        )
        err = await c.until_type("error", 10)
        assert (err["error"]["code"], err["error"]["param"]) == ("unknown_delegation", "delegation_id"), err
        assert err["error"]["client_event_id"] == "bad"
        # Replies may speak freely again (a sparse update of the extension; the delay is kept).
        await c.conn.session.update(
            session={"delegation": {"type": "client", "tool_choice": "auto"}}, event_id="u"
        )
        updated = await c.until_type("session.updated", 10)
        assert updated["session"]["delegation"] == {
            "type": "client",
            "acknowledgement_delay_ms": 0,
            "tool_choice": "auto",
        }

        answered = len(c.events)
        await c.conn.session.commentary.append(
            content="The weather in Paris today is sunny and 18 degrees.",
            delegation_id=d["id"],
            event_id="answer",
        )
        ack = await c.until_type("session.commentary.appended", 10)
        assert ack["client_event_id"] == "answer"
        await c.until(lambda e: e["type"] == "session.output_transcript.delta", 40, "the spoken answer")
        # The words come with their audio, after whatever of the acknowledgement is still playing: read until the
        # speech has stopped for 3 s (a fixed 4 s after the first word cut the answer off on a busy machine).
        is_words = lambda e: e["type"] == "session.output_transcript.delta"  # noqa: E731
        for _ in range(10):
            if not await c.quiet(3.0, is_words):
                break
        spoken = c.said(answered).lower()
        assert "sunny" in spoken or "18" in spoken, spoken
        assert not [e for e in c.events[answered:] if e["type"] == "session.delegation.created"]


# --- LiveKit's stock GPTLiveModel --------------------------------------------------------------------------------


#: What the engine says while a call's result is awaited (acknowledgement_delay_ms).
ACKNOWLEDGEMENT = "One moment, please."


def continuation(session: AgentSession) -> str:
    """The agent's words after its tool's result went back (LiveKit's function_call_output in the history): the
    continuation, without the engine's acknowledgement."""
    items = session.history.items
    out = next((i for i, item in enumerate(items) if item.type == "function_call_output"), None)
    if out is None:
        return ""
    words = [
        (item.text_content or "").replace(ACKNOWLEDGEMENT, "")
        for item in items[out:]
        if item.type == "message" and item.role == "assistant"
    ]
    return " ".join(w.strip() for w in words if w.strip())


async def _livekit_weather(model: GPTLiveModel) -> tuple[list[str], AgentSession, list[Any]]:
    """An AgentSession over ``model`` whose agent has a ``@function_tool get_weather``, asked in speech about the
    weather in Paris: waits for the tool to run and for an answer after it. Returns the cities the tool ran with,
    the session (closed) and the errors it reported."""
    ran: list[str] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        ran.append(city)
        return "It is 18 degrees and sunny."

    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(24000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    try:
        await session.start(agent=Agent(instructions=INSTRUCTIONS, tools=[get_weather]))
        await mic.say(synthesize_speech(WEATHER_QUESTION, rate=24000))
        await wait_until(lambda: ran, 60, "the tool to run")
        await wait_until(lambda: continuation(session), 60, "the continuation after the tool's result")
        await asyncio.sleep(2.0)
    finally:
        await session.aclose()
        await model.aclose()
    return ran, session, errors


@pytest.mark.models
async def test_livekit_gpt_live_model_runs_its_function_tool_when_the_backend_must_call(
    server: ServerProcess,
) -> None:
    """LiveKit's own tool flow over stock ``GPTLiveModel`` with its option ``tool_choice: "required"``: the
    delegation's call runs the agent's ``@function_tool`` once (LiveKit dedups by call id), LiveKit returns the
    result with ``response.item.create`` + ``response.create``, and the continuation is spoken."""
    model = GPTLiveModel(
        base_url=f"{server.url}/v1", api_key=API_KEY, responses_options={"tool_choice": "required"}
    )
    ran, session, errors = await _livekit_weather(model)
    assert len(ran) == 1 and isinstance(ran[0], str), ran
    assert continuation(session), history_messages(session, "assistant")
    assert not errors, errors


@pytest.mark.models
async def test_livekit_agent_session_runs_its_function_tool_over_gpt_live_model(
    server: ServerProcess,
) -> None:
    """The acceptance test: a LiveKit AgentSession over stock ``GPTLiveModel(base_url, api_key)`` (its defaults:
    responses delegation, tool_choice auto) whose agent has a ``@function_tool`` is asked, in speech, about the
    weather in Paris: the tool runs once, with Paris, and the spoken answer carries its result; a plain question
    after it is answered without a call."""
    ran: list[str] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        ran.append(city)
        return "It is 18 degrees and sunny."

    model = GPTLiveModel(base_url=f"{server.url}/v1", api_key=API_KEY)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(24000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    try:
        await session.start(agent=Agent(instructions=INSTRUCTIONS, tools=[get_weather]))
        await mic.say(synthesize_speech(WEATHER_QUESTION, rate=24000))
        await wait_until(lambda: ran, 30, "the tool to run")
        await wait_until(
            lambda: any("18" in m or "sunny" in m.lower() for m in history_messages(session, "assistant")),
            60,
            "an answer with the tool's result",
        )
        await asyncio.sleep(2.0)
        before = len([m for m in history_messages(session, "assistant") if m.strip()])
        await mic.say(synthesize_speech("What is the capital of France?", rate=24000))
        await wait_until(
            lambda: len([m for m in history_messages(session, "assistant") if m.strip()]) > before,
            60,
            "the answer to the plain question",
        )
        await asyncio.sleep(2.0)
    finally:
        await session.aclose()
        await model.aclose()
    assert [c.lower() for c in ran] == ["paris"], ran
    assert not errors, errors
