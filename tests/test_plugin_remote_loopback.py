"""The remote plugin against real ``livekit-omni serve`` processes whose engine runs the loopback echo *test
fixture* (no models): audio both ways over the Live WebSocket, what goes on the wire, reconnects that re-seed the
conversation, bounded retries, and the engine occupancy a remote worker reports (GET /health).

Only LiveKit's room is replaced (tests/plugin_harness.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import Agent, AgentSession, llm

from livekit_omni import EngineOccupancy, OmniDuplexModel
from livekit_omni.live import wire
from livekit_omni.plugin.remote import RemoteSession
from tests.conftest import EVENT_LOG, ROOT, ServerProcess, free_port, start_server
from tests.plugin_harness import Mic, Recorder, Speaker

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): outages and reconnects of an agent session.
pytestmark = pytest.mark.slow

C = TypeVar("C", bound=wire.ClientCommand)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(adapter="loopback", env={"LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "2"})
    yield srv
    srv.stop()


def serve_on(port: int, env: dict[str, str] | None = None) -> ServerProcess:
    """A loopback ``livekit-omni serve`` on a chosen port (a restarted server must come back where it was)."""
    sock = str(Path(tempfile.mkdtemp(prefix="lko-test-")) / "engine.sock")
    log_path = ROOT / "test-output" / f"server-{port}-{time.monotonic_ns()}.log"
    full_env = {
        **os.environ,
        "LIVEKIT_OMNI_ENGINE__ADDRESS": "unix:" + sock,
        "LIVEKIT_OMNI_EVENT_LOG": str(EVENT_LOG),
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "livekit_omni.cli", "serve", "--port", str(port), "--adapter", "loopback"]
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=logf, stderr=subprocess.STDOUT)
    srv = ServerProcess(f"http://127.0.0.1:{port}", port, proc, log_path, sock)
    srv.wait_ready(60)
    return srv


def tone(seconds: float, rate: int = 24_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)


def sent(events: list[wire.ClientCommand], kind: type[C]) -> list[C]:
    return [e for e in events if isinstance(e, kind)]


async def test_audio_round_trip_and_usage_in_an_agent_session(server: ServerProcess) -> None:
    model = OmniDuplexModel(base_url=server.url + "/v1")
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(16_000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    rec = Recorder(session)
    await session.start(Agent(instructions="echo"))
    duplex = session.current_agent.duplex_session
    assert isinstance(duplex, RemoteSession)
    rec.watch_duplex(duplex)
    assert await asyncio.wait_for(duplex.wait_ready(), 10)
    assert duplex.session_id
    await mic.say(tone(1.0, 16_000))
    await rec.wait_for(lambda: speaker.loud_seconds() >= 0.8, 10, "the echo over the WebSocket")
    # The server sends usage every few seconds, cumulatively; LiveKit gets deltas that add up to the session time.
    t0 = time.monotonic()
    await rec.wait_for(lambda: len(rec.of("duplex.metrics_collected")) >= 2, 15, "usage updates")
    total = sum(m.session_duration for m in rec.of("duplex.metrics_collected"))
    assert 0 < total <= (time.monotonic() - t0) + 6
    assert duplex.output_frames_dropped == 0 and duplex.input_frames_dropped == 0
    assert not rec.of("duplex.error")
    await session.aclose()
    await model.aclose()


async def test_context_on_the_wire_before_and_after_start(server: ServerProcess) -> None:
    model = OmniDuplexModel(base_url=server.url + "/v1", voice="marin")
    s = model.session()
    assert isinstance(s, RemoteSession)
    events: list[wire.ClientCommand] = []
    s.on("omni_client_event", events.append)
    ctx = llm.ChatContext.empty()
    ctx.add_message(role="system", content="Speak French.", id="i1")
    ctx.add_message(role="user", content="My name is Bob.", id="i2")
    ctx.add_message(role="assistant", content="Hello Bob.", id="i3")
    await s._update_session(instructions="You are terse.", chat_ctx=ctx, tools=[])
    assert await asyncio.wait_for(s.wait_ready(), 10)
    (start_event,) = sent(events, wire.SessionStart)
    start = json.loads(wire.encode(start_event))["session"]  # as it crossed the wire
    assert start["instructions"] == "You are terse."
    assert start["audio"] == {"format": {"type": "audio/pcm", "rate": 24_000}, "output": {"voice": "marin"}}
    # A responses delegation (GPT-Live's default), so that tools can be added later; none yet.
    assert start["delegation"] == {"type": "responses", "responses": {"model": "livekit-omni"}}
    assert [(i["role"], i["content"][0]["text"]) for i in start["input"]] == [
        ("developer", "Speak French."),
        ("user", "My name is Bob."),
        ("assistant", "Hello Bob."),
    ]
    # After start: the same items again are not re-sent; new ones are appends (system → instructions, rest → one
    # thinking append), as GPT-Live does.
    ctx.add_message(role="developer", content="Be kind.", id="i4")
    ctx.add_message(role="user", content="I like tea.", id="i5")
    ctx.add_message(role="assistant", content="Noted.", id="i6")
    await s._append_items(ctx.items)
    await s._update_instructions("You are chatty.")
    s._generate_reply(instructions="Say hello.")
    s._generate_reply()
    await asyncio.sleep(0.5)
    appends = [
        (wire.event_type(e), e.content)
        for e in events
        if isinstance(e, wire.InstructionsAppend | wire.ThinkingAppend | wire.CommentaryAppend)
    ]
    assert appends == [
        ("session.instructions.append", "Be kind."),
        ("session.thinking.append", "user: I like tea.\nassistant: Noted."),
        ("session.instructions.append", "You are chatty."),
        ("session.commentary.append", "Say hello."),
        ("session.commentary.append", ""),  # the engine's speak-now
    ]
    # New tools (and the framework's tool choice) go to the delegation with session.update.
    await s._update_tools([llm.function_tool(lambda: "x", name="f", description="d")])
    s._update_options(tool_choice="required")
    s._update_options(tool_choice=None)
    await asyncio.sleep(0.5)
    updates = [json.loads(wire.encode(e))["session"]["delegation"] for e in sent(events, wire.SessionUpdate)]
    assert updates == [
        {
            "type": "responses",
            "responses": {
                "tools": [
                    {
                        "type": "function",
                        "name": "f",
                        "description": "d",
                        "parameters": {"properties": {}, "title": "<lambda>Args", "type": "object"},
                    }
                ],
                "tool_choice": "auto",
            },
        },
        {"type": "responses", "responses": {"tool_choice": "required"}},
        {"type": "responses", "responses": {"tool_choice": "auto"}},
    ], updates
    await s.aclose()
    assert sent(events, wire.SessionClose), "a clean close asks the server to finalize"
    await model.aclose()


async def test_a_session_the_server_ends_is_reseeded_with_the_conversation() -> None:
    """The server expires sessions after 3 s: the plugin reconnects at once and starts a new session carrying
    the conversation so far, with the mute re-applied, and tells LiveKit it reconnected."""
    srv = start_server(adapter="loopback", env={"LIVEKIT_OMNI_LIMITS__SESSION_LIFETIME_S": "3"})
    try:
        model = OmniDuplexModel(base_url=srv.url + "/v1")
        s = model.session()
        events: list[wire.ClientCommand] = []
        errors: list[llm.RealtimeModelError] = []
        reconnected: list[object] = []
        s.on("omni_client_event", events.append)
        s.on("error", errors.append)
        s.on("session_reconnected", reconnected.append)
        ctx = llm.ChatContext.empty()
        ctx.add_message(role="user", content="My name is Bob.", id="u1")
        await s._update_session(instructions="Be brief.", chat_ctx=ctx, tools=[])
        assert await asyncio.wait_for(s.wait_ready(), 10)
        first = s.session_id
        s.append_thinking("The caller likes tea.")
        s.mute_input()
        for _ in range(200):
            if reconnected and s.session_id not in (None, first):
                break
            await asyncio.sleep(0.05)
        assert reconnected and s.session_id != first
        starts = sent(events, wire.SessionStart)
        assert len(starts) == 2
        replay = [(i.role, i.content[0].text) for i in starts[1].session.input or []]
        assert replay == [("user", "My name is Bob."), ("developer", "The caller likes tea.")]
        assert starts[1].session.instructions == "Be brief."
        second_start = events.index(starts[1])
        assert sent(events[second_start:], wire.InputAudioMute), "the mute is re-applied"
        # Reported as a recoverable error; the session goes on.
        assert errors and all(e.recoverable for e in errors)
        await s.aclose()
        await model.aclose()
    finally:
        srv.stop()


async def test_outage_reconnects_then_exhausted_retries_end_the_agent_session() -> None:
    port = free_port()
    srv = serve_on(port)
    try:
        model = OmniDuplexModel(base_url=f"http://127.0.0.1:{port}/v1", max_retries=4, retry_interval_s=1.0)
        session = AgentSession(llm=model, aec_warmup_duration=None)
        mic, speaker = Mic(24_000), Speaker()
        session.input.audio, session.output.audio = mic, speaker
        rec = Recorder(session)
        await session.start(Agent(instructions="echo"))
        duplex = session.current_agent.duplex_session
        rec.watch_duplex(duplex)
        assert await asyncio.wait_for(duplex.wait_ready(), 10)
        # The server goes away and comes back on the same port: the retries (0.1, 1, 2, 4 s) bridge the gap.
        srv.stop()
        srv = serve_on(port)
        await rec.wait_for(lambda: bool(rec.of("duplex.session_reconnected")), 20, "the reconnect")
        assert await asyncio.wait_for(duplex.wait_ready(), 10)
        await mic.say(tone(0.6))
        await rec.wait_for(lambda: speaker.loud_seconds() >= 0.4, 10, "audio after the reconnect")
        # Now it stays away: after max_retries more attempts the session ends with an unrecoverable error.
        srv.stop()
        t0 = time.monotonic()
        await asyncio.wait_for(rec.closed.wait(), 30)
        errors = rec.of("duplex.error")
        assert errors[-1].recoverable is False and "after 5 attempts" in str(errors[-1].error)
        assert sum(1 for e in errors if e.recoverable) >= 4
        assert time.monotonic() - t0 < 15  # 0.1 + 1 + 2 + 4 s of backoff plus the refused connects
        assert rec.close_event.reason.value == "error"
        await model.aclose()
    finally:
        srv.stop()


async def test_remote_load_is_the_servers_engine_occupancy(server: ServerProcess) -> None:
    load = EngineOccupancy(base_url=server.url + "/v1")
    assert await load.aload() == 0.0
    model = OmniDuplexModel(base_url=server.url + "/v1")
    s = model.session()
    await s._update_session(instructions="", chat_ctx=llm.ChatContext.empty(), tools=[])
    assert await asyncio.wait_for(s.wait_ready(), 10)
    assert await load.aload() == 0.5  # one of the engine's two sessions
    s.push_audio(rtc.AudioFrame(tone(0.02).tobytes(), 24_000, 1, 480))
    await model.aclose()
    for _ in range(50):
        if await load.aload() == 0.0:
            break
        await asyncio.sleep(0.1)
    assert await load.aload() == 0.0
    assert EngineOccupancy(base_url="http://127.0.0.1:9/v1", timeout_s=0.5).load() == 1.0
