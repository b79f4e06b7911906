"""Function tools over the Realtime dialect, driven by the openai SDK's ``client.realtime.connect()`` against a real
server with the embedded models; every server event of each test is validated against the SDK's types.

The embedded SmolLM2-135M calls a tool when a reply must (``tool_choice: "required"`` or a named function); which
replies should call under ``auto`` is the thinker's concern, so the calls here are asked for explicitly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from livekit.agents import Agent, AgentSession, function_tool
from livekit.plugins.openai.realtime import RealtimeModel

from tests.conftest import ServerProcess, start_server
from tests.plugin_harness import Mic, Speaker, history_messages, wait_until
from tests.realtime_sdk import API_KEY, INSTRUCTIONS, SdkCaller, sdk_caller
from tests.speech_fixtures import synthesize_speech

pytestmark = pytest.mark.models

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


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(adapter="cascade", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield s
    s.stop()


def calls_of(done: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in done["response"].get("output", []) if o["type"] == "function_call"]


async def ask_in_text(c: SdkCaller, question: str, response: dict[str, Any]) -> dict[str, Any]:
    """A user text item, then ``response.create`` with ``response``; the response's ``response.done``."""
    await c.conn.send(
        {
            "type": "conversation.item.create",
            "item": {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": question}],
            },
        }
    )
    await c.conn.send({"type": "response.create", "response": response})
    created = await c.until("response.created")
    rid = created["response"]["id"]
    return await c.logged(lambda e: e["type"] == "response.done" and e["response"]["id"] == rid, 60)


async def test_spoken_question_function_call_round_trip(server: ServerProcess) -> None:
    """Session tools with ``required``: the caller's spoken question ends in a ``get_weather`` call with the
    events the SDK reads (output item added, the arguments' delta and done, output item done, conversation item
    done, response.done holding it); the client's ``function_call_output`` and ``response.create`` (``none``)
    give a spoken answer that says the result."""
    async with sdk_caller(server, {"tools": [WEATHER, ORDER], "tool_choice": "required"}) as c:
        c.say(WEATHER_QUESTION)
        done = await c.until("response.done", 60)
        assert done["response"]["status"] == "completed", done
        calls = calls_of(done)
        assert len(calls) == 1, done["response"]["output"]
        call = calls[0]
        args = json.loads(call["arguments"])
        jsonschema.validate(args, CITY)
        # Which city SmolLM2-135M fills in is the thinker's concern (tests/test_engine_tools.py).
        assert call["name"] == "get_weather", call
        rid = done["response"]["id"]
        mine = [e for e in c.log.events if e.get("response_id") == rid]
        types = [e["type"] for e in mine]
        for t in (
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ):
            assert t in types, types
        args_done = next(e for e in mine if e["type"] == "response.function_call_arguments.done")
        assert args_done["call_id"] == call["call_id"] and args_done["arguments"] == call["arguments"]
        assert args_done["item_id"] == call["id"] and args_done["name"] == "get_weather"
        deltas = "".join(e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta")
        assert deltas == call["arguments"]
        item_done = [e for e in c.log.of("conversation.item.done") if e["item"]["id"] == call["id"]]
        assert item_done and item_done[0]["item"]["status"] == "completed"

        await c.conn.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT},
            }
        )
        added = await c.until("conversation.item.added")
        assert added["item"]["type"] == "function_call_output" and added["item"]["call_id"] == call["call_id"]
        await c.conn.send({"type": "response.create", "response": {"tool_choice": "none"}})
        answer = await c.until("response.done", 60)
    resp = answer["response"]
    assert resp["status"] == "completed" and calls_of(answer) == [], resp
    transcript = resp["output"][0]["content"][0]["transcript"]
    assert "18" in transcript or "sunny" in transcript.lower(), transcript
    assert len(c.audio.get(resp["id"], b"")) > 24000 * 2 * 0.3, "the answer is spoken"


async def test_tools_the_engine_cannot_use_are_refused_at_session_update(server: ServerProcess) -> None:
    """A schema the grammar library cannot compile, a non-function tool and a choice naming no tool are each an
    ``error`` on ``session.update`` (nothing echoed); the session goes on with its tools."""
    bad_schema = {
        "type": "function",
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}},
    }
    async with sdk_caller(server, {"tools": [WEATHER]}, mic=False) as c:
        for session, code in (
            ({"tools": [bad_schema]}, "invalid_value"),
            ({"tools": [{"type": "mcp", "server_label": "x"}]}, "invalid_value"),
            ({"tool_choice": {"type": "function", "name": "nope"}}, "invalid_value"),
        ):
            await c.conn.send({"type": "session.update", "session": {"type": "realtime", **session}})
            err = await c.until("error", 20)
            assert err["error"]["code"] == code, err
            assert err["error"]["param"].startswith("session.tool"), err
        assert not [e for e in c.log.of("session.updated")[1:]], "a refused update is not echoed"
        done = await ask_in_text(c, "What is the weather like in Rome?", {"tool_choice": "required"})
        assert [call["name"] for call in calls_of(done)] == ["get_weather"]


async def test_a_response_with_tools_of_its_own_then_the_sessions_again(server: ServerProcess) -> None:
    async with sdk_caller(server, {"tools": [WEATHER]}, mic=False) as c:
        own = await ask_in_text(c, "Where is my order 4417?", {"tools": [ORDER], "tool_choice": "required"})
        calls = calls_of(own)
        assert [call["name"] for call in calls] == ["get_order_status"], own
        jsonschema.validate(json.loads(calls[0]["arguments"]), ORDER_ARGS)
        again = await ask_in_text(c, WEATHER_QUESTION, {"tool_choice": "required"})
        assert [call["name"] for call in calls_of(again)] == ["get_weather"], again


async def test_cancel_while_the_call_is_generated_makes_no_call(server: ServerProcess) -> None:
    async with sdk_caller(server, {"tools": [WEATHER]}, mic=False) as c:
        await c.conn.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": WEATHER_QUESTION}],
                },
            }
        )
        await c.conn.send({"type": "response.create", "response": {"tool_choice": "required"}})
        await c.until("response.created")
        await c.conn.send({"type": "response.cancel"})
        done = await c.until("response.done", 30)
        assert done["response"]["status"] == "cancelled", done
        assert calls_of(done) == [] and not c.log.of("response.function_call_arguments.done")


async def test_barge_in_while_a_call_is_pending_and_a_late_result_is_not_spoken(
    server: ServerProcess,
) -> None:
    """The call reached the client; before its result the caller asks something else, which is answered in words
    (``auto``); the result arriving after that joins the conversation silently (no response until the client
    asks); the call's items can be retrieved and deleted like any other."""
    async with sdk_caller(server, {"tools": [WEATHER]}) as c:
        called = await ask_in_text(c, WEATHER_QUESTION, {"tool_choice": "required"})
        call = calls_of(called)[0]
        c.say("What is the capital of France?")
        answer = await c.until("response.done", 60)
        assert calls_of(answer) == [] and answer["response"]["status"] == "completed", answer
        transcript = answer["response"]["output"][0]["content"][0]["transcript"]
        assert "paris" in transcript.lower(), transcript
        await c.conn.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT},
            }
        )
        await c.until("conversation.item.done")
        with pytest.raises(TimeoutError):
            await c.until("response.created", 3)
        await c.conn.send({"type": "conversation.item.retrieve", "item_id": call["id"]})
        got = await c.until("conversation.item.retrieved")
        assert got["item"]["type"] == "function_call" and got["item"]["arguments"] == call["arguments"]
        await c.conn.send({"type": "conversation.item.delete", "item_id": call["id"]})
        assert (await c.until("conversation.item.deleted"))["item_id"] == call["id"]


async def test_livekit_agent_session_runs_its_function_tool_over_realtime_model(
    server: ServerProcess,
) -> None:
    """A LiveKit AgentSession over stock ``RealtimeModel(base_url, api_key)`` whose agent has a ``@function_tool``
    is asked, in speech, about the weather in Paris: the tool runs once, with Paris, through LiveKit's own tool
    execution, and the spoken answer carries its result; a plain question after it is answered without a call."""
    ran: list[str] = []

    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        ran.append(city)
        return "It is 18 degrees and sunny."

    model = RealtimeModel(base_url=f"{server.url}/v1", api_key=API_KEY)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(24000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    try:
        await session.start(agent=Agent(instructions=INSTRUCTIONS, tools=[get_weather]))
        await mic.say(synthesize_speech(WEATHER_QUESTION, rate=24000))
        await wait_until(lambda: ran, 60, "the tool to run")
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
    finally:
        await session.aclose()
        await model.aclose()
    assert [c.lower() for c in ran] == ["paris"], ran
    assert not errors, errors


async def test_a_configured_acknowledgement_is_spoken_while_the_result_is_awaited() -> None:
    """``realtime_acknowledgement_delay_ms`` (a server setting: the dialect has none): a call whose result has not
    come after that long is followed by a spoken acknowledgement, a response of the server's own; the result then
    gets its answer as usual."""
    env = {
        "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
        "LIVEKIT_OMNI_REALTIME_ACKNOWLEDGEMENT_DELAY_MS": "300",
    }
    server = start_server(adapter="cascade", env=env)
    try:
        async with sdk_caller(server, {"tools": [WEATHER]}, mic=False) as c:
            called = await ask_in_text(c, WEATHER_QUESTION, {"tool_choice": "required"})
            call = calls_of(called)[0]
            ack = await c.until("response.done", 20)
            assert calls_of(ack) == [] and ack["response"]["status"] == "completed", ack
            assert ack["response"]["output"][0]["content"][0]["transcript"] == "One moment, please."
            assert len(c.audio.get(ack["response"]["id"], b"")) > 24000 * 2 * 0.3, "it is spoken"
            await c.conn.send(
                {
                    "type": "conversation.item.create",
                    "item": {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT},
                }
            )
            await c.conn.send({"type": "response.create", "response": {"tool_choice": "none"}})
            answer = await c.until("response.done", 60)
            assert answer["response"]["status"] == "completed" and calls_of(answer) == [], answer
    finally:
        server.stop()
