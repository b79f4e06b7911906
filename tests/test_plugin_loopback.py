"""The co-located plugin's data plane and failure paths against a real engine process running the loopback echo
*test fixture* (no models: the engine echoes caller audio 200 ms later), inside a real ``AgentSession``.

Only LiveKit's room is replaced (tests/plugin_harness.py: in-memory microphone and speaker).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import Agent, AgentSession, function_tool, llm

from engine_bridge.client import EngineClient
from livekit_omni import OmniDuplexModel
from livekit_omni.plugin.colocated import ColocatedSession
from tests.conftest import EngineProcess, connect_engine, spawn_engine
from tests.plugin_harness import Mic, Recorder, Speaker

#: The module's engine process (the `engine` and `client` fixtures of tests/conftest.py).
ENGINE_SETTINGS = {"adapter": "loopback", "max_sessions": 2}


def tone(seconds: float, rate: int, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)


async def configure(s: llm.DuplexSession, instructions: str = "") -> None:
    await s._update_session(instructions=instructions, chat_ctx=llm.ChatContext.empty(), tools=[])


async def ready_session(model: OmniDuplexModel, instructions: str = "") -> ColocatedSession:
    """A co-located session of ``model``, configured as AgentSession does, once the engine says it is ready."""
    s = model.session()
    assert isinstance(s, ColocatedSession)
    await configure(s, instructions)
    assert await asyncio.wait_for(s.wait_ready(), 10)
    return s


async def test_agent_session_hears_the_engine_in_real_time(
    engine: EngineProcess, client: EngineClient
) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    # 48 kHz stereo in: the plugin downmixes and the ingress writer resamples to the engine's 16 kHz.
    mic, speaker = Mic(48_000, channels=2), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    rec = Recorder(session)
    await session.start(Agent(instructions="echo"))
    duplex = session.current_agent.duplex_session
    assert isinstance(duplex, ColocatedSession)
    rec.watch_duplex(duplex)
    assert await asyncio.wait_for(duplex.wait_ready(), 10)
    assert (await client.ping()).active_sessions == 1
    t0 = time.monotonic()
    sent_at = await mic.say(tone(1.0, 48_000))
    await rec.wait_for(lambda: speaker.loud_seconds() >= 0.9, 10, "the echo to be played")
    first_loud = next(t for t, f in speaker.frames if np.abs(np.frombuffer(f.data, np.int16)).max() > 500)
    # The echo starts ~200 ms (engine delay) after the tone started, i.e. about 0.8 s before its end.
    assert first_loud - (sent_at - 1.0) < 0.6
    await asyncio.sleep(0.5)
    stats = duplex.stats()
    elapsed = time.monotonic() - t0
    # Paced output: 50 frames a second, silence included; every caller frame reached the ring.
    assert stats["egress"]["frames"] / (elapsed + 0.3) == pytest.approx(50, rel=0.15)
    assert stats["input_frames_dropped"] == 0 and stats["ingress"]["overruns"] == 0
    assert stats["ingress"]["samples_written"] >= 16_000
    # What the agent played is the engine's 24 kHz output, the tone's pitch intact.
    loud = np.concatenate(
        [np.frombuffer(f.data, np.int16) for _, f in speaker.frames if f.sample_rate == 24_000]
    ).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(loud))
    assert abs(np.fft.rfftfreq(loud.shape[0], 1 / 24_000)[spectrum.argmax()] - 440) < 5
    assert not rec.of("error") and not rec.of("duplex.error")
    await session.aclose()
    await model.aclose()
    assert (await client.ping()).active_sessions == 0


async def test_push_audio_never_blocks_and_drops_the_oldest(
    engine: EngineProcess, client: EngineClient
) -> None:
    model = OmniDuplexModel(engine_address=engine.address, input_queue_frames=50)
    s = model.session()
    assert isinstance(s, ColocatedSession)
    frames = [rtc.AudioFrame(tone(0.02, 24_000).tobytes(), 24_000, 1, 480) for _ in range(2000)]
    # Before the session is configured nothing is consumed: the queue holds the newest 50 frames.
    t0 = time.perf_counter()
    for f in frames:
        s.push_audio(f)
    per_call = (time.perf_counter() - t0) / len(frames)
    assert per_call < 50e-6, f"push_audio took {per_call * 1e6:.1f} µs"
    assert s.input_frames_dropped == 1950
    await configure(s)
    for _ in range(100):
        if s.stats()["ingress"].get("samples_written", 0) >= 50 * 320:
            break
        await asyncio.sleep(0.05)
    assert s.stats()["ingress"]["samples_written"] == 50 * 320  # 50 frames of 20 ms at 16 kHz
    await s.aclose()
    await model.aclose()


async def test_aclose_releases_the_engine_session_and_its_rings(
    engine: EngineProcess, client: EngineClient
) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    s = await ready_session(model, "be brief")
    es = s._es
    assert es is not None
    names = es.rings.names
    assert all(Path("/dev/shm", n).exists() for n in names)
    assert (await client.ping()).active_sessions == 1
    await s.aclose()
    assert es.closed and not any(Path("/dev/shm", n).exists() for n in names)
    assert (await client.ping()).active_sessions == 0
    # A closed session refuses further steering clearly.
    with pytest.raises(llm.RealtimeError):
        s.append_thinking("too late")
    await model.aclose()


async def test_a_full_engine_is_an_unrecoverable_error(engine: EngineProcess, client: EngineClient) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    sessions = [model.session() for _ in range(3)]
    errors: list[llm.RealtimeModelError] = []
    sessions[2].on("error", errors.append)
    for s in sessions[:2]:
        await configure(s)
        assert await asyncio.wait_for(s.wait_ready(), 10)
    assert (await client.ping()).active_sessions == 2
    await configure(sessions[2])
    assert not await asyncio.wait_for(sessions[2].wait_ready(), 10)
    assert len(errors) == 1 and errors[0].recoverable is False
    assert isinstance(errors[0].error, llm.RealtimeError) and "session_limit_reached" in str(errors[0].error)
    await model.aclose()
    assert (await client.ping()).active_sessions == 0


async def test_an_agent_with_tools_on_an_engine_without_them_fails_to_start_naming_them(
    engine: EngineProcess, client: EngineClient
) -> None:
    """The loopback fixture has no model to call tools: the engine refuses the session's tools when it opens, and
    the agent's start fails with a ``RealtimeError`` (``invalid_tools``) naming them; nothing stays open."""

    @function_tool
    async def lookup(city: str) -> str:
        """Weather for a city."""
        return city

    model = OmniDuplexModel(engine_address=engine.address)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    session.input.audio, session.output.audio = Mic(), Speaker()
    with pytest.raises(llm.RealtimeError, match="lookup") as refused:
        await session.start(Agent(instructions="x", tools=[lookup]))
    assert refused.value.code == "invalid_tools"
    await session.aclose()
    await model.aclose()
    assert (await client.ping()).active_sessions == 0


async def test_losing_the_engine_closes_the_agent_session_with_an_error() -> None:
    eng = spawn_engine(adapter="loopback", max_sessions=1)
    try:
        client = await connect_engine(eng)
        await client.close()
        model = OmniDuplexModel(engine_address=eng.address)
        session = AgentSession(llm=model, aec_warmup_duration=None)
        session.input.audio, session.output.audio = Mic(), Speaker()
        rec = Recorder(session)
        await session.start(Agent(instructions="x"))
        duplex = session.current_agent.duplex_session
        rec.watch_duplex(duplex)
        assert await asyncio.wait_for(duplex.wait_ready(), 10)
        os.kill(eng.proc.pid, signal.SIGKILL)
        await asyncio.wait_for(rec.closed.wait(), 10)
        errors = rec.of("duplex.error")
        assert errors and errors[-1].recoverable is False and "engine" in str(errors[-1].error)
        assert rec.close_event.reason.value == "error"
        await model.aclose()
    finally:
        eng.stop()


async def test_open_session_writes_caller_frames_in_push_audio_and_ticks_the_output_with_them(
    engine: EngineProcess, client: EngineClient
) -> None:
    model = OmniDuplexModel(engine_address=engine.address)
    s = await ready_session(model)
    got: list[float] = []

    async def read() -> None:
        async for _ in s.audio_stream:
            got.append(time.monotonic())

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.1)
    frame = rtc.AudioFrame(tone(0.02, 48_000).tobytes(), 48_000, 1, 960)
    for _ in range(25):
        before = s.stats()["ingress"]["samples_written"]
        s.push_audio(frame)
        # Into the ring within the call (no hop to another task), resampled to 16 kHz.
        assert s.stats()["ingress"]["samples_written"] - before == 320
        await asyncio.sleep(0.02)
    # One output frame per caller frame, each released by the caller frame's arrival (none by the timer once
    # the phases locked), still 50 a second.
    assert s._pacer.early >= 20
    assert len(got) == pytest.approx(30, abs=3)
    reader.cancel()
    await s.aclose()
    await model.aclose()
