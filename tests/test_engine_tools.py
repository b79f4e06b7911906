"""Function tools on a voice session of the cascade engine (real models, real engine process): the reply that calls a
tool ends in ``ReplyDone.tool_calls`` with arguments valid for the schema, the call and its result stay in the
conversation (the result's turn prefills only its own tokens), the answer after the result is built on it, tools
the grammar library cannot compile are refused when the session opens or updates, and a barge-in cuts a call off.

SmolLM2-135M calls reliably only when a reply must (``required`` or a named function), so the calls here are asked
for per reply; what ``auto`` does is the thinker's own concern (tests/test_thinker_tools.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from engine_bridge.control import EngineRequestError
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import synthesize_speech

pytestmark = pytest.mark.models

#: The module's engine process (the `engine` and `client` fixtures of tests/conftest.py).
ENGINE_SETTINGS = {"adapter": "cascade", "max_sessions": 3, "idle_ttl_s": 60}

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = p.ToolDef(
    name="get_weather", description="Get the current weather in a given city.", parameters=CITY
)
ORDER = p.ToolDef(
    name="get_order_status",
    description="Look up the delivery status of an order by its number.",
    parameters={
        "type": "object",
        "properties": {"order_number": {"type": "integer"}},
        "required": ["order_number"],
    },
)
REQUIRED = p.ToolChoiceSpec(mode="required")
RESULT = '{"city": "Paris", "temperature_c": 18, "sky": "sunny"}'


async def _reply(d: SessionDriver, kind: p.AppendKind, text: str = "", **kw: object) -> p.ReplyDone:
    """Append, then play until the next reply is done; that reply's ReplyDone."""
    before = len(d.of(p.ReplyDone))
    await d.session.append_text(kind, text, **kw)  # type: ignore[arg-type]
    await d.run(seconds=0, until=lambda d: len(d.of(p.ReplyDone)) > before)
    done: p.ReplyDone = d.of(p.ReplyDone)[before]
    return done


async def test_a_required_call_is_valid_and_the_answer_after_its_result_uses_it(client: EngineClient) -> None:
    session = await client.open_session(p.SessionConfig(tools=[WEATHER]))
    d = SessionDriver(session)
    await session.append_text("user", "What is the weather like in Paris today?")
    called = await _reply(d, "respond", tool_choice=REQUIRED)
    assert len(called.tool_calls) == 1, called
    call = called.tool_calls[0]
    args = json.loads(call.arguments)
    jsonschema.validate(args, CITY if call.name == "get_weather" else ORDER.parameters)
    assert call.name == "get_weather" and args["city"].lower() == "paris", call
    assert call.call_id.startswith("call_")

    stats = await session.stats()
    log_before = stats.extra["thinker"]["log_tokens"]
    await session.append_text("tool_result", RESULT, call_id=call.call_id)
    answer = await _reply(d, "respond")
    assert answer.tool_calls == [] and answer.text and not answer.interrupted
    assert d.audio_of_turn(answer.turn_id).shape[0] > 0, "the answer is spoken"
    # The call and its result are turns of the conversation like any other: the answer's reply reused the KV of
    # everything before the result (nothing re-prefilled).
    assert answer.cached_tokens >= log_before, (answer.cached_tokens, log_before)
    stats = await session.stats()
    roles = [e.role for e in stats.log]
    assert roles[-3:] == ["assistant", "tool", "assistant"], roles
    await session.close()


async def test_the_answer_after_a_result_says_what_the_tool_returned(client: EngineClient) -> None:
    """The result is written as the model's tool format reads one (SmolLM2: "Tool result: key: value; ...",
    not JSON in tags, which it read back or talked about), and the spoken answer says it."""
    session = await client.open_session(p.SessionConfig(tools=[WEATHER]))
    d = SessionDriver(session)
    await session.append_text("user", "What is the weather like in Paris today?")
    called = await _reply(d, "respond", tool_choice=REQUIRED)
    await session.append_text("tool_result", RESULT, call_id=called.tool_calls[0].call_id)
    answer = await _reply(d, "respond")
    await session.close()
    assert "18" in answer.text or "sunny" in answer.text.lower(), answer.text


async def test_a_named_function_choice_calls_that_function(client: EngineClient) -> None:
    session = await client.open_session(p.SessionConfig(tools=[WEATHER, ORDER]))
    d = SessionDriver(session)
    await session.append_text("user", "Where is my order 4417?")
    done = await _reply(d, "respond", tool_choice=p.ToolChoiceSpec(mode="function", name="get_order_status"))
    assert [c.name for c in done.tool_calls] == ["get_order_status"], done
    args = json.loads(done.tool_calls[0].arguments)
    jsonschema.validate(args, ORDER.parameters)
    await session.close()


async def test_a_spoken_question_under_a_required_session_choice_makes_the_call(client: EngineClient) -> None:
    """The caller's own words (VAD, whisper) start the reply, which calls the tool instead of speaking."""
    session = await client.open_session(p.SessionConfig(tools=[WEATHER], tool_choice=REQUIRED))
    d = SessionDriver(session)
    question = synthesize_speech("What is the weather like in Paris today?", lead_silence_ms=300)
    await d.run(question, seconds=0, until=lambda d: bool(d.of(p.ReplyDone)))
    done = d.of(p.ReplyDone)[0]
    assert [c.name for c in done.tool_calls] == ["get_weather"], done
    jsonschema.validate(json.loads(done.tool_calls[0].arguments), CITY)
    await session.close()


async def test_a_spoken_city_is_the_calls_argument(client: EngineClient) -> None:
    """The caller's words become the call's argument: a session with tools hears its turns with whisper's whole
    window (the fitted one hears this question, in the test voice, as "... in pairs today?")."""
    session = await client.open_session(p.SessionConfig(tools=[WEATHER], tool_choice=REQUIRED))
    d = SessionDriver(session)
    question = synthesize_speech("What is the weather like in Paris today?", lead_silence_ms=300)
    await d.run(question, seconds=0, until=lambda d: bool(d.of(p.ReplyDone)))
    await session.close()
    done = d.of(p.ReplyDone)[0]
    assert json.loads(done.tool_calls[0].arguments)["city"].lower() == "paris", done


async def test_tools_the_grammar_cannot_compile_are_refused_at_open_and_update(client: EngineClient) -> None:
    bad = p.ToolDef(
        name="lookup", parameters={"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}}
    )
    with pytest.raises(EngineRequestError) as refused:
        await client.open_session(p.SessionConfig(tools=[bad]))
    assert refused.value.code == p.ErrorCode.INVALID_TOOLS and "lookup" in str(refused.value)
    with pytest.raises(EngineRequestError) as refused:
        await client.open_session(
            p.SessionConfig(tools=[WEATHER], tool_choice=p.ToolChoiceSpec(mode="function", name="nope"))
        )
    assert refused.value.code == p.ErrorCode.INVALID_TOOLS and "nope" in str(refused.value)

    session = await client.open_session(p.SessionConfig(tools=[WEATHER]))
    with pytest.raises(EngineRequestError) as refused:
        await session.update(tools=[bad])
    assert refused.value.code == p.ErrorCode.INVALID_TOOLS
    # The session goes on with its tools.
    d = SessionDriver(session)
    await session.append_text("user", "What is the weather like in Rome?")
    done = await _reply(d, "respond", tool_choice=REQUIRED)
    assert [c.name for c in done.tool_calls] == ["get_weather"]
    await session.close()


async def test_new_tools_by_update_are_the_ones_called(client: EngineClient) -> None:
    session = await client.open_session(p.SessionConfig(tools=[WEATHER]))
    d = SessionDriver(session)
    await session.update(tools=[ORDER], tool_choice=REQUIRED)
    await session.append_text("user", "Where is my order 4417?")
    done = await _reply(d, "respond")
    assert [c.name for c in done.tool_calls] == ["get_order_status"], done
    await session.close()


async def test_an_interrupt_while_the_reply_runs_makes_no_call(client: EngineClient) -> None:
    """A reply cut off before it ends has made no call: its ReplyDone is interrupted and carries none."""
    session = await client.open_session(p.SessionConfig(tools=[WEATHER]))
    d = SessionDriver(session)
    await session.append_text("user", "What is the weather like in Paris today?")
    before = len(d.of(p.ReplyDone))
    # The interrupt follows the request at once: the reply has started (the mailbox keeps their order) and is
    # still generating its call (a dozen tokens or more), on any machine.
    await session.append_text("respond", "", tool_choice=REQUIRED)
    await session.interrupt()
    await d.run(seconds=0, until=lambda d: len(d.of(p.ReplyDone)) > before)
    done = d.of(p.ReplyDone)[before]
    assert done.interrupted and done.tool_calls == [], done
    await session.close()


async def test_a_caller_waiting_on_a_call_hears_an_acknowledgement_after_the_delay(
    client: EngineClient,
) -> None:
    """``acknowledgement_delay_ms``: with no result by then, the caller hears one short acknowledgement (spoken,
    and in the conversation as the assistant's); a result in time means none."""
    session = await client.open_session(p.SessionConfig(tools=[WEATHER], acknowledgement_delay_ms=500))
    d = SessionDriver(session)
    await session.append_text("user", "What is the weather like in Paris today?")
    called = await _reply(d, "respond", tool_choice=REQUIRED)
    assert called.tool_calls, called
    done_at = d.timed(p.ReplyDone)[-1][0]
    await d.run(seconds=0, until=lambda d: len(d.of(p.ReplyDone)) > 1)
    ack = d.of(p.ReplyDone)[1]
    started_at = next(t for t, ev in d.timed(p.ReplyStarted) if getattr(ev, "turn_id", None) == ack.turn_id)
    assert ack.text == "One moment, please." and not ack.tool_calls, ack
    assert d.audio_of_turn(ack.turn_id).shape[0] > 0, "the acknowledgement is spoken"
    assert 0.45 <= started_at - done_at < 3.0, started_at - done_at
    # Once: the caller goes on waiting without another acknowledgement.
    await d.run(seconds=1.5)
    assert len(d.of(p.ReplyDone)) == 2
    stats = await session.stats()
    assert stats.extra["acknowledgements"] == 1 and stats.log[-1].text == "One moment, please."

    # The result before the delay: no acknowledgement.
    await session.update(acknowledgement_delay_ms=1500)
    await session.append_text("user", "And in Rome?")
    again = await _reply(d, "respond", tool_choice=REQUIRED)
    assert again.tool_calls, again
    await session.append_text("tool_result", RESULT, call_id=again.tool_calls[0].call_id)
    await d.run(seconds=2.0)
    assert len(d.of(p.ReplyDone)) == 3, [e.text for e in d.of(p.ReplyDone)]
    await session.close()
