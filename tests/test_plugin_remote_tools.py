"""Function tools on ``OmniDuplexModel`` in remote mode: the Live protocol's responses delegation
(OpenAI's Live API), as LiveKit's GPT-Live speaks it (docs/protocol.md: what this server serves).

* Without a server: what the plugin puts on the wire for the agent's tools (``session.start``'s delegation, the
  ``response.item.create`` and ``response.create`` of a result and its answer) and how it reads the server's
  ``response.event`` envelopes (a call becomes LiveKit's ``function_call``; a result that arrives after the
  caller's next turn is not answered). Frames are the protocol's own shapes, read by the plugin's decoder; no
  server is stood in.
* With a real ``livekit-omni serve`` (embedded cascade), an ``AgentSession`` whose agent has a ``@function_tool``:
  these run once the Live dialect serves tools under ``delegation: responses`` (it refuses ``response.create`` as
  unsupported until then, and the tests are skipped).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from livekit.agents import Agent, AgentSession, function_tool, llm

from livekit_omni import OmniDuplexModel
from livekit_omni.live import wire
from livekit_omni.plugin.remote import (
    RemoteSession,
    ResponseCreate,
    ResponseItemCreate,
    decode_response_event,
)
from livekit_omni.plugin.session import STALE_RESULT
from tests.conftest import ServerProcess, start_server
from tests.plugin_harness import Mic, Recorder, Speaker, history_messages, wait_until, words
from tests.speech_fixtures import synthesize_speech

INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
WEATHER_QUESTION = "What is the weather like in Paris today?"
RESULT = "It is 18 degrees and sunny in Paris."
#: Whether this checkout's Live dialect serves tools (it lists the responses commands as unsupported until then).
LIVE_SERVES_TOOLS = "response.create" not in wire.UNSUPPORTED_COMMANDS
needs_live_tools = pytest.mark.skipif(
    not LIVE_SERVES_TOOLS,
    reason="the Live dialect does not serve function tools under delegation: responses yet "
    "(response.create is unsupported in livekit_omni/live/wire.py)",
)


@function_tool
async def get_weather(city: str) -> str:
    """Get the current weather in a given city."""
    return RESULT


def response_event(event: dict[str, Any], delegation_id: str | None = "dlg_1") -> str:
    return json.dumps(
        {"type": "response.event", "event_id": "ev_1", "delegation_id": delegation_id, "event": event}
    )


def call_done(call_id: str = "call_1") -> str:
    return response_event(
        {
            "type": "response.output_item.done",
            "output_index": 0,
            "item": {
                "type": "function_call",
                "id": "fc_1",
                "call_id": call_id,
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",
            },
        }
    )


def queued(s: RemoteSession) -> list[Any]:
    return list(s._control)


async def test_tools_travel_in_the_responses_delegation_and_calls_come_back_as_function_calls() -> None:
    model = OmniDuplexModel(
        base_url="http://127.0.0.1:9/v1", tool_choice="required", acknowledgement_delay_ms=500
    )
    s = model.session()
    assert isinstance(s, RemoteSession)
    calls: list[llm.FunctionCall] = []
    s.on("function_call", calls.append)
    try:
        await s._update_tools([get_weather])
        start = json.loads(wire.encode(s._session_start_event()))["session"]
        delegation = start["delegation"]
        assert delegation["type"] == "responses" and delegation["acknowledgement_delay_ms"] == 500
        responses = delegation["responses"]
        assert responses["model"] == "livekit-omni" and responses["tool_choice"] == "required"
        (tool,) = responses["tools"]
        assert tool["type"] == "function" and tool["name"] == "get_weather"
        assert tool["description"] == "Get the current weather in a given city."
        assert tool["parameters"]["properties"]["city"]["type"] == "string"

        # As on a started connection: a backend response makes the call, LiveKit runs it.
        s._config_sent = True
        for frame in (
            response_event(
                {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}
            ),
            call_done(),
            call_done(),  # a repeated item is delivered once
        ):
            envelope = decode_response_event(frame)
            assert envelope is not None
            s._on_response_event(envelope)
        assert [(c.call_id, c.name, c.arguments, c.id) for c in calls] == [
            ("call_1", "get_weather", '{"city": "Paris"}', "fc_1")
        ]
        assert (
            decode_response_event(json.dumps({"type": "session.usage.updated", "usage": {"seconds": 1}}))
            is None
        )

        # The result goes back as a function_call_output; the answer waits until the response that called ends.
        out = llm.FunctionCallOutput(call_id="call_1", name="get_weather", output=RESULT, is_error=False)
        await s._append_items([out])
        s._update_options(tool_choice="auto")
        s._generate_reply()
        s._update_options(tool_choice=None)
        commands = queued(s)
        item_creates = [c for c in commands if isinstance(c, ResponseItemCreate)]
        assert [json.loads(wire.encode(c)) for c in item_creates] == [
            {
                "type": "response.item.create",
                "event_id": item_creates[0].event_id,
                "item": {"type": "function_call_output", "call_id": "call_1", "output": RESULT},
            }
        ]
        assert not [c for c in commands if isinstance(c, ResponseCreate)], (
            "sent while the response still runs"
        )
        s._on_response_event(
            decode_response_event(
                response_event({"type": "response.completed", "response": {"id": "resp_1"}})
            )  # type: ignore[arg-type]
        )
        creates = [c for c in queued(s) if isinstance(c, ResponseCreate)]
        assert len(creates) == 1 and json.loads(wire.encode(creates[0]))["type"] == "response.create"
        # The framework's choice for the answer, then its own restored, each a delegation update.
        updates = [
            json.loads(wire.encode(c))["session"]["delegation"]["responses"]
            for c in queued(s)
            if isinstance(c, wire.SessionUpdate)
        ]
        assert updates == [{"tool_choice": "auto"}, {"tool_choice": "required"}]

        # A call whose result arrives after the caller's next words is not answered.
        s._on_response_event(decode_response_event(call_done("call_2")))  # type: ignore[arg-type]
        s._on_transcript("user", wire.InputTranscriptDelta(delta="And in Rome?", start_ms=9000, end_ms=9600))
        late = llm.FunctionCallOutput(call_id="call_2", name="get_weather", output=RESULT, is_error=False)
        await s._append_items([late])
        before = len([c for c in queued(s) if isinstance(c, ResponseCreate)])
        with pytest.raises(llm.RealtimeError) as stale:
            s._generate_reply()
        assert stale.value.code == STALE_RESULT
        assert len([c for c in queued(s) if isinstance(c, ResponseCreate)]) == before
        assert [c.item.call_id for c in queued(s) if isinstance(c, ResponseItemCreate)] == [
            "call_1",
            "call_2",
        ]
    finally:
        await s.aclose()
        await model.aclose()


# --- against a real server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(adapter="cascade")
    yield srv
    srv.stop()


@pytest.mark.models
@needs_live_tools
async def test_agent_session_runs_its_function_tool_over_the_live_websocket(server: ServerProcess) -> None:
    """``tool_choice="required"``: the spoken question ends in a call, LiveKit runs the tool once, the result goes
    back over the delegation and the answer after it is spoken."""
    ran: list[str] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        ran.append(city)
        return RESULT

    model = OmniDuplexModel(base_url=server.url + "/v1", tool_choice="required", connect_timeout_s=30)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(24_000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    rec = Recorder(session)
    sent: list[str] = []
    try:
        await session.start(Agent(instructions=INSTRUCTIONS, tools=[get_weather]))
        duplex = session.current_agent.duplex_session
        assert isinstance(duplex, RemoteSession)
        rec.watch_duplex(duplex)
        duplex.on("omni_client_event", lambda ev: sent.append(ev.__struct_config__.tag))
        await mic.say(synthesize_speech(WEATHER_QUESTION, rate=24_000))
        await wait_until(lambda: ran, 60, "the tool to run")
        outputs = lambda: [i for i in session.history.items if i.type == "function_call_output"]  # noqa: E731
        await wait_until(outputs, 30, "the result to be recorded")
        n = len(history_messages(session, "assistant"))
        await wait_until(
            lambda: any(words(m) for m in history_messages(session, "assistant")[n:]), 60, "the spoken answer"
        )
    finally:
        await session.aclose()
        await model.aclose()
    assert len(ran) >= 1, rec.summary()
    assert "response.item.create" in sent and "response.create" in sent, sent
    assert not rec.of("duplex.error"), rec.summary()


@pytest.mark.models
@needs_live_tools
async def test_tools_the_server_cannot_use_fail_the_agent_start_naming_them(server: ServerProcess) -> None:
    lookup = function_tool(
        lambda raw_arguments: "",
        raw_schema={
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}},
        },
    )
    model = OmniDuplexModel(base_url=server.url + "/v1", connect_timeout_s=30)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    session.input.audio, session.output.audio = Mic(), Speaker()
    try:
        with pytest.raises(llm.RealtimeError, match="lookup") as refused:
            await asyncio.wait_for(session.start(Agent(instructions=INSTRUCTIONS, tools=[lookup])), 90)
        assert refused.value.code == "invalid_tools"
    finally:
        await session.aclose()
        await model.aclose()
