"""Acceptance: a real ``AgentSession`` on ``OmniDuplexModel`` in co-located mode (shared-memory rings, local control
channel) against a real engine process running the embedded cascade (VAD → whisper → SmolLM2 → Piper).

The caller is Piper speech fed at real time through an in-memory microphone; the agent's audio goes to an
in-memory speaker (tests/plugin_harness.py). Only LiveKit's room is replaced: it needs a LiveKit server.
One engine serves the whole module (its models take ~15 s to load).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import llm

from engine_bridge.client import EngineClient
from livekit_omni import OmniDuplexModel
from livekit_omni.plugin.colocated import ColocatedSession
from tests.conftest import EngineProcess
from tests.plugin_harness import (
    STORY,
    Conversation,
    assistant_between,
    chat,
    final_before_stop,
    start_conversation,
    words,
)

pytestmark = pytest.mark.models

INSTRUCTIONS = "You are a helpful assistant. Answer briefly."


#: The module's engine process (the `engine` and `client` fixtures of tests/conftest.py).
ENGINE_SETTINGS = {"adapter": "cascade", "max_sessions": 3, "idle_ttl_s": 60}


def reply_count(conv: Conversation) -> int:
    return len([r for r in conv.rec.of("duplex.omni_reply_done") if not r.interrupted])


async def ask(conv: Conversation, text: str, timeout: float = 60) -> list[str]:
    """Say ``text``; wait until the engine has finished its answer and the agent is listening again. Returns the
    assistant messages that arrived meanwhile."""
    before_msgs = len(conv.texts("assistant"))
    before = reply_count(conv)
    await conv.say(text)
    await conv.rec.wait_for(lambda: reply_count(conv) > before, timeout, f"the answer to {text!r}")
    await conv.settle(quiet_s=1.0)
    return conv.texts("assistant")[before_msgs:]


async def test_two_spoken_turns_and_a_barge_in(engine: EngineProcess, client: EngineClient) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    conv = await start_conversation(model, rate=48_000, instructions=INSTRUCTIONS)
    assert isinstance(conv.duplex, ColocatedSession)
    t0 = time.monotonic()
    try:
        # Turn 1 and 2: the caller's words land in the history, each followed by an answer.
        first = await ask(conv, "Hello, my name is Alice.")
        assert first and any(words(t) for t in first), conv.rec.summary()
        second = await ask(conv, "What is the capital of France?")
        assert "paris" in words(" ".join(second)), conv.rec.summary()
        users = conv.texts("user")
        assert len(users) == 2
        assert "alice" in words(users[0]) and {"capital", "france"} <= set(words(users[1]))
        assert final_before_stop(conv.rec)

        # Turn 3: a long answer, and the caller talks over it once ~1.5 s of it has played.
        story_from = len(chat(conv.rec))
        barges_before = len(conv.rec.of("duplex.omni_barge_in"))
        loud0 = conv.speaker.loud_seconds()
        conv.session.generate_reply(instructions=STORY)
        await conv.rec.wait_for(lambda: conv.speaker.loud_seconds() - loud0 > 1.5, 60, "the story to play")
        await conv.say("Wait, stop. What is the capital of France?")
        await conv.rec.wait_for(
            lambda: len(conv.rec.of("duplex.omni_barge_in")) > barges_before, 10, "the barge-in"
        )
        barge = conv.rec.of("duplex.omni_barge_in")[barges_before]
        story_done = next(r for r in conv.rec.of("duplex.omni_reply_done") if r.turn_id == barge.turn_id)
        assert story_done.interrupted
        t_barge = [t for t, n, _ in conv.rec.events if n == "duplex.omni_barge_in"][barges_before]
        await conv.rec.wait_for(
            lambda: any(
                r.turn_id > barge.turn_id and not r.interrupted for r in conv.rec.of("duplex.omni_reply_done")
            ),
            60,
            "the next answer",
        )
        await conv.settle(quiet_s=1.0)
        # The answer stops: between the barge-in and the next answer the agent played nothing (the stale audio
        # was dropped within a frame).
        next_reply_start = min(
            t
            for t, n, ev in conv.rec.events
            if n == "agent_state_changed" and t > t_barge and ev.new_state == "speaking"
        )
        stale = [
            t for t, f in conv.speaker.frames if t_barge + 0.1 < t < next_reply_start - 0.05 and _loud(f)
        ]
        assert not stale, f"{len(stale)} loud frames played after the barge-in"
        # The story's message holds only what was played.
        story, question = assistant_between(conv.rec, story_from)
        following = assistant_between(conv.rec, question + 1)[0]
        told, kept = words(story), words(story_done.text)
        # The engine keeps what the caller heard at full level; the words that played under the duck reach no client
        # (the media plane holds their transcript until the verdict), so the message is that, plus at most the
        # word in flight when the duck came.
        assert kept and told[: len(kept)] == kept and len(told) - len(kept) <= 1, (story, story_done.text)
        assert 0 < len(told) < 30 and barge.played_ms > 1000
        # The next answer follows the caller's interrupting question.
        assert words(following), conv.rec.summary()
        assert {"capital", "france"} <= set(words(conv.texts("user")[-1]))
        # The engine's own log agrees: the interrupted reply is marked, and holds the kept words.
        stats = await conv.duplex.engine_stats()
        seg = next(s for s in stats.log if s.role == "assistant" and s.turn_id == barge.turn_id)
        assert seg.interrupted and words(seg.text) == kept

        # Usage goes to LiveKit as deltas: the session's total is the audio time, not a running sum of sums.
        usage = conv.session.usage.model_usage
        assert usage and 0 < usage[0].session_duration <= time.monotonic() - t0 + 1
        assert not [e for e in conv.rec.of("duplex.error")], conv.rec.summary()
    finally:
        await conv.aclose()
        await model.aclose()
    assert (await client.ping()).active_sessions == 0


def _loud(frame: rtc.AudioFrame) -> bool:
    return bool(np.abs(np.frombuffer(frame.data, np.int16)).max(initial=0) > 500)


async def test_two_agent_sessions_on_one_engine_keep_separate_conversations(
    engine: EngineProcess, client: EngineClient
) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    a = await start_conversation(model, rate=48_000, instructions=INSTRUCTIONS)
    b = await start_conversation(model, rate=24_000, instructions=INSTRUCTIONS)
    try:
        assert (await client.ping()).active_sessions == 2
        answers = await asyncio.gather(
            ask(a, "What is the capital of France?", timeout=90),
            ask(b, "How many legs does a spider have?", timeout=90),
        )
        said_a, said_b = (set(words(" ".join(x))) for x in answers)
        assert "paris" in said_a and not said_a & {"spider", "legs"}, answers
        assert said_b & {"eight", "8", "legs", "spider"} and "paris" not in said_b, answers
        assert {"capital", "france"} <= set(words(a.texts("user")[0]))
        assert {"spider", "legs"} <= set(words(b.texts("user")[0]))
        # Each engine session logged only its own caller.
        for conv, mine, other in ((a, "france", "spider"), (b, "spider", "france")):
            assert isinstance(conv.duplex, ColocatedSession)
            log = " ".join(s.text for s in (await conv.duplex.engine_stats()).log if s.role == "user")
            assert mine in words(log) and other not in words(log)
    finally:
        await a.aclose()
        await b.aclose()
        await model.aclose()
    assert (await client.ping()).active_sessions == 0


async def test_context_reaches_the_engine_once_and_in_order(engine: EngineProcess) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    s = model.session()
    assert isinstance(s, ColocatedSession)
    ctx = llm.ChatContext.empty()
    ctx.add_message(role="system", content="Speak French.", id="i1")
    ctx.add_message(role="user", content="My name is Bob.", id="i2")
    ctx.add_message(role="assistant", content="Hello Bob.", id="i3")
    try:
        await s._update_session(instructions="You are terse.", chat_ctx=ctx, tools=[])
        assert await asyncio.wait_for(s.wait_ready(), 30)
        # A handoff that reuses the session sends the whole context again: only what is new reaches the engine.
        ctx.add_message(role="developer", content="Be kind.", id="i4")
        ctx.add_message(role="user", content="I like tea.", id="i5")
        await s._append_items(ctx.items)
        await s._update_instructions("You are chatty.")
        await s._update_instructions("You are chatty.")
        for _ in range(100):
            log = (await s.engine_stats()).log
            if len(log) >= 7:
                break
            await asyncio.sleep(0.05)
        assert [(e.role, e.text) for e in log] == [
            ("system", "You are terse."),
            ("developer", "Speak French."),
            ("user", "My name is Bob."),
            ("assistant", "Hello Bob."),
            ("developer", "Be kind."),
            ("developer", "user: I like tea."),
            ("developer", "You are chatty."),
        ]
    finally:
        await s.aclose()
        await model.aclose()
