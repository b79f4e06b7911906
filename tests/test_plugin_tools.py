"""Acceptance: an agent's function tools on ``OmniDuplexModel`` in co-located mode, inside a real ``AgentSession``,
against a real engine process running the embedded cascade (VAD → whisper → SmolLM2 → Piper).

The engine's model calls the tool at the end of a reply (``ReplyDone.tool_calls``), the plugin hands the call to
LiveKit (``function_call``), LiveKit runs the agent's ``@function_tool``, the result goes back to the engine as the
call's result and the framework asks for the answer, which is spoken.

The caller is Piper speech fed at real time through an in-memory microphone; the agent's audio goes to an
in-memory speaker (tests/plugin_harness.py). Only LiveKit's room is replaced: it needs a LiveKit server. The embedded
SmolLM2-135M calls a tool reliably only when a reply must (``tool_choice="required"``), so the plumbing tests set
the plugin's ``tool_choice`` option; the test with the defaults is the acceptance test of the model's own choice.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from livekit.agents import Agent, AgentSession, FunctionToolsExecutedEvent, function_tool, llm

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from livekit_omni import OmniDuplexModel
from livekit_omni.plugin.colocated import ColocatedSession
from livekit_omni.plugin.session import STALE_RESULT
from tests.conftest import EngineProcess
from tests.plugin_harness import Conversation, Mic, Recorder, Speaker, history_messages, wait_until, words

pytestmark = pytest.mark.models

INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
WEATHER_QUESTION = "What is the weather like in Paris today?"
RESULT = "It is 18 degrees and sunny in Paris."

#: The engine compiles a grammar for the tools of each session it opens; on a small, busy CPU the first one takes
#: seconds, so the open may take longer than the plugin's default 10 s.
OPEN_S = 30.0

#: The module's engine process (the `engine` and `client` fixtures of tests/conftest.py).
ENGINE_SETTINGS = {"adapter": "cascade", "max_sessions": 3, "idle_ttl_s": 60}


async def start_agent(model: OmniDuplexModel, agent: Agent, *, rate: int = 24_000) -> Conversation:
    """An AgentSession on ``model`` running ``agent``, with an in-memory caller, once the engine session is open."""
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(rate), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    rec = Recorder(session)
    await session.start(agent)
    duplex = session.current_agent.duplex_session
    assert isinstance(duplex, ColocatedSession)
    rec.watch_duplex(duplex)
    assert await asyncio.wait_for(duplex.wait_ready(), 2 * OPEN_S), "the duplex session did not open"
    return Conversation(session, mic, speaker, rec, duplex)


def items(session: AgentSession) -> list[Any]:
    return list(session.history.items)


def answer_after_result(session: AgentSession) -> str:
    """The agent's words after the last tool result in the session's history ("" while there are none)."""
    history = items(session)
    last = max((i for i, item in enumerate(history) if item.type == "function_call_output"), default=None)
    if last is None:
        return ""
    return " ".join(
        item.text_content or ""
        for item in history[last + 1 :]
        if item.type == "message" and item.role == "assistant"
    ).strip()


def weather_tool(ran: list[str], *, before_result: Any = None) -> llm.FunctionTool:
    @function_tool
    async def get_weather(city: str) -> str:
        """Get the current weather in a given city."""
        ran.append(city)
        if before_result is not None:
            await before_result()
        return RESULT

    return get_weather


async def test_a_required_call_runs_the_agents_tool_and_the_answer_is_spoken(
    engine: EngineProcess, client: EngineClient, caplog: pytest.LogCaptureFixture
) -> None:
    """``tool_choice="required"``: the caller's spoken question ends in a call; LiveKit runs ``get_weather`` once
    with arguments valid for its schema, records the call and its output, the result reaches the engine as the
    call's result, and the answer asked for after it (under the framework's ``auto``) is spoken; the session's own
    choice is back to the option afterwards."""
    caplog.set_level(logging.WARNING, logger="livekit.agents")
    ran: list[str] = []
    executed: list[FunctionToolsExecutedEvent] = []
    model = OmniDuplexModel(engine_address=engine.address, tool_choice="required", connect_timeout_s=OPEN_S)
    conv = await start_agent(model, Agent(instructions=INSTRUCTIONS, tools=[weather_tool(ran)]))
    conv.session.on("function_tools_executed", executed.append)
    duplex = conv.duplex
    assert isinstance(duplex, ColocatedSession)
    try:
        assert set(duplex.tools.function_tools) == {"get_weather"}
        assert duplex.tool_choice == p.ToolChoiceSpec(mode="required")
        loud_before = conv.speaker.loud_seconds()
        await conv.say(WEATHER_QUESTION)
        await wait_until(lambda: ran, 60, "the tool to run")
        await wait_until(lambda: words(answer_after_result(conv.session)), 60, "the answer after the result")
        await conv.settle(quiet_s=1.5)
        log = (await duplex.engine_stats()).log
        choice_after = duplex.tool_choice
    finally:
        await conv.aclose()
        await model.aclose()
    summary = conv.rec.summary()
    assert len(ran) >= 1 and isinstance(ran[0], str), (ran, summary)
    call = executed[0].function_calls[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}, call
    output = executed[0].function_call_outputs[0]
    assert output.call_id == call.call_id and output.output == RESULT and not output.is_error
    history = items(conv.session)
    kinds = [item.type for item in history]
    assert "function_call" in kinds and "function_call_output" in kinds, kinds
    assert kinds.index("function_call") < kinds.index("function_call_output")
    # The answer was played (a message holds what was played) and heard.
    assert words(answer_after_result(conv.session)), summary
    assert conv.speaker.loud_seconds() - loud_before > 0.3
    # The engine's conversation: the caller's question, the call, its result, then the answer built on it.
    roles = [e.role for e in log]
    assert "tool" in roles, [(e.role, e.text) for e in log]
    tool_at = roles.index("tool")
    assert log[tool_at].text == RESULT
    assert "user" in roles[:tool_at] and "assistant" in roles[:tool_at]
    assert any(e.role == "assistant" and words(e.text) for e in log[tool_at + 1 :]), log
    # The framework set "auto" for the answer and restored its own (None): the option's choice again.
    assert choice_after == p.ToolChoiceSpec(mode="required")
    assert not conv.rec.of("error") and not conv.rec.of("duplex.error"), summary
    # The answer was the reply the framework asked for (not a timeout, nor a refused ask).
    assert not [r for r in caplog.records if "failed to generate a reply" in r.getMessage()], caplog.text
    assert (await client.ping()).active_sessions == 0


async def test_asked_in_speech_with_the_defaults_the_tool_runs_once_with_paris_and_the_answer_carries_it(
    engine: EngineProcess, client: EngineClient
) -> None:
    """The plugin with its defaults (``tool_choice`` auto): asked about the weather in Paris, the model calls
    ``get_weather`` once, with Paris, LiveKit runs it, and the spoken answer carries its result."""
    ran: list[str] = []
    model = OmniDuplexModel(engine_address=engine.address, connect_timeout_s=OPEN_S)
    conv = await start_agent(model, Agent(instructions=INSTRUCTIONS, tools=[weather_tool(ran)]))
    try:
        await conv.say(WEATHER_QUESTION)
        await wait_until(lambda: ran, 60, "the tool to run")
        await wait_until(
            lambda: any(
                "18" in m or "sunny" in m.lower() for m in history_messages(conv.session, "assistant")
            ),
            60,
            "an answer with the tool's result",
        )
        await conv.settle(quiet_s=1.5)
    finally:
        await conv.aclose()
        await model.aclose()
    assert [c.lower() for c in ran] == ["paris"], ran
    assert not conv.rec.of("duplex.error"), conv.rec.summary()


async def test_tools_the_engine_cannot_use_are_refused_with_an_error_naming_them(
    engine: EngineProcess, client: EngineClient
) -> None:
    """A parameters schema the engine's grammar library cannot compile: an agent starting with it fails to start
    with a ``RealtimeError`` (``invalid_tools``) naming the tool; an agent that adds it later gets that error from
    ``update_tools`` and its session goes on with the tools it had."""
    lookup = function_tool(
        lambda raw_arguments: "",
        raw_schema={
            "name": "lookup",
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"q": {"$ref": "#/$defs/missing"}}},
        },
    )
    model = OmniDuplexModel(engine_address=engine.address, connect_timeout_s=OPEN_S)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    session.input.audio, session.output.audio = Mic(), Speaker()
    try:
        with pytest.raises(llm.RealtimeError, match="lookup") as refused:
            await session.start(Agent(instructions=INSTRUCTIONS, tools=[lookup]))
        assert refused.value.code == "invalid_tools"
    finally:
        await session.aclose()

    ran: list[str] = []
    weather = weather_tool(ran)
    agent = Agent(instructions=INSTRUCTIONS, tools=[weather])
    conv = await start_agent(model, agent)
    duplex = conv.duplex
    assert isinstance(duplex, ColocatedSession)
    try:
        with pytest.raises(llm.RealtimeError, match="lookup") as later:
            await agent.update_tools([weather, lookup])
        assert later.value.code == "invalid_tools"
        assert set(duplex.tools.function_tools) == {"get_weather"}
        # The engine kept the session and its tools: a required reply still calls get_weather.
        duplex.set_tool_choice("required")
        duplex.append_thinking(f"user: {WEATHER_QUESTION}")
        duplex.speak_now()
        await wait_until(lambda: ran, 60, "the kept tool to be called")
        assert not conv.rec.of("duplex.error") and not conv.rec.closed.is_set(), conv.rec.summary()
    finally:
        await conv.aclose()
        await model.aclose()
    assert (await client.ping()).active_sessions == 0


async def test_a_result_that_arrives_after_the_callers_next_turn_is_not_spoken(
    engine: EngineProcess, client: EngineClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The call reached LiveKit and its tool is still running when the caller asks something else: that question is
    answered, the tool's late result then joins the engine's conversation, but the answer the framework asks for
    is refused (``tool_result_after_caller_turn``) and nothing more is spoken; the session goes on, no crash."""
    caplog.set_level(logging.ERROR, logger="livekit.agents")
    ran: list[str] = []
    release = asyncio.Event()
    conv_box: list[Conversation] = []

    async def hold_result() -> None:
        # The caller's next question is answered in words; the result waits for the test.
        duplex = conv_box[0].duplex
        assert isinstance(duplex, ColocatedSession)
        duplex.set_tool_choice("auto")
        await release.wait()

    model = OmniDuplexModel(engine_address=engine.address, tool_choice="required", connect_timeout_s=OPEN_S)
    conv = await start_agent(
        model, Agent(instructions=INSTRUCTIONS, tools=[weather_tool(ran, before_result=hold_result)])
    )
    conv_box.append(conv)
    duplex = conv.duplex
    assert isinstance(duplex, ColocatedSession)
    try:
        await conv.say(WEATHER_QUESTION)
        await wait_until(lambda: ran, 60, "the tool to start")
        done_before = len(conv.rec.of("duplex.omni_reply_done"))
        await conv.say("What is the capital of France?")
        await conv.rec.wait_for(
            lambda: any(
                words(r.text) and not r.interrupted
                for r in conv.rec.of("duplex.omni_reply_done")[done_before:]
            ),
            60,
            "the answer to the next question",
        )
        # Played and recorded (the agent stays "thinking" meanwhile: the tool is still running).
        await wait_until(lambda: history_messages(conv.session, "assistant"), 10, "the answer to be recorded")
        await asyncio.sleep(1.0)
        replies = len(conv.rec.of("duplex.omni_reply_done"))
        messages = len(history_messages(conv.session, "assistant"))
        frames = len(conv.speaker.frames)
        release.set()
        await wait_until(
            lambda: any(item.type == "function_call_output" for item in items(conv.session)),
            20,
            "the late result to be recorded",
        )
        await asyncio.sleep(6.0)  # an answer would have started well within this
        log = (await duplex.engine_stats()).log
        assert len(conv.rec.of("duplex.omni_reply_done")) == replies, conv.rec.summary()
        assert len(history_messages(conv.session, "assistant")) == messages
        assert not [f for _, f in conv.speaker.frames[frames:] if _loud(f)], (
            "something was spoken after the result"
        )
        # The result is in the engine's conversation, after the answer to the caller's next question.
        roles = [e.role for e in log]
        assert "tool" in roles and log[roles.index("tool")].text == RESULT, [(e.role, e.text) for e in log]
        assert roles.index("tool") > max(i for i, r in enumerate(roles) if r == "user")
        # The framework asked, and was told why there is no answer.
        assert any(
            STALE_RESULT in r.getMessage() or "the caller spoke after" in r.getMessage()
            for r in caplog.records
        )
        assert not conv.rec.of("duplex.error") and not conv.rec.closed.is_set(), conv.rec.summary()
    finally:
        release.set()
        await conv.aclose()
        await model.aclose()
    assert ran == ran[:1], ran


def _loud(frame: Any) -> bool:
    import numpy as np

    return bool(np.abs(np.frombuffer(frame.data, np.int16)).max(initial=0) > 500)


async def test_a_call_the_app_puts_into_the_conversation_reaches_the_engine_as_a_call_and_its_result(
    engine: EngineProcess, client: EngineClient
) -> None:
    """After start, a function call in a context update that the model did not make (the app's) goes to the engine
    as the assistant's call (``tool_call``) and its output as that call's result (``tool_result``); an output for
    a call nobody knows is narrated as context."""
    ran: list[str] = []
    model = OmniDuplexModel(engine_address=engine.address, connect_timeout_s=OPEN_S)
    s = model.session()
    assert isinstance(s, ColocatedSession)
    try:
        await s._update_session(
            instructions=INSTRUCTIONS, chat_ctx=llm.ChatContext.empty(), tools=[weather_tool(ran)]
        )
        assert await asyncio.wait_for(s.wait_ready(), 2 * OPEN_S)
        await s._append_items(
            [
                llm.FunctionCall(call_id="app_1", name="get_weather", arguments='{"city": "Rome"}'),
                llm.FunctionCallOutput(call_id="app_1", name="get_weather", output="Rainy.", is_error=False),
                llm.FunctionCallOutput(call_id="nobody", name="lookup", output="42", is_error=False),
            ]
        )
        for _ in range(100):
            log = (await s.engine_stats()).log
            if len(log) >= 4:
                break
            await asyncio.sleep(0.05)
    finally:
        await s.aclose()
        await model.aclose()
    # The system segment: the instructions, then the tools as the model's tool format lists them.
    assert log[0].role == "system" and log[0].text.startswith(INSTRUCTIONS) and "get_weather" in log[0].text
    assert [(e.role, e.text) for e in log[1:]] == [
        ("assistant", ""),  # the call, as the model's own (its tool format renders it in the thinker's log)
        ("tool", "Rainy."),
        ("developer", "developer: Tool lookup returned 42"),
    ], log
    assert not ran
    assert (await client.ping()).active_sessions == 0
