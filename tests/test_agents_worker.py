"""The agent workers (agents/room_agent.py, agents/sip_agent.py) without a LiveKit server: their load function
against a real engine, and a job simulated by LiveKit's own ``AgentServer.simulate_job`` on an unregistered
server, running the real agent code on the real plugin and engine (loopback echo *test fixture*, no models).

What cannot run here is the LiveKit server (and so the room): the simulated job is LiveKit's fake job, and the
room's audio is replaced by the in-memory microphone and speaker of tests/plugin_harness.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import AgentServer, JobContext, JobExecutorType, llm
from livekit.rtc._proto import participant_pb2 as proto_participant
from livekit.rtc._proto import room_pb2 as proto_room

from agents import room_agent, sip_agent
from engine_bridge.client import EngineClient
from livekit_omni import EngineOccupancy, OmniDuplexModel
from livekit_omni.plugin.worker import AgentSettings, SessionIO
from media.codecs import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from tests.conftest import EngineProcess, free_port
from tests.plugin_harness import Mic, Speaker

#: The module's engine process (the `engine` and `client` fixtures of tests/conftest.py).
ENGINE_SETTINGS = {"adapter": "loopback", "max_sessions": 2}


async def test_load_function_reports_engine_occupancy(engine: EngineProcess, client: EngineClient) -> None:
    load = EngineOccupancy(engine_address=engine.address)
    try:
        assert await load.aload() == 0.0
        model = OmniDuplexModel(engine_address=engine.address)
        sessions = [model.session() for _ in range(2)]
        for i, s in enumerate(sessions):
            await s._update_session(instructions="", chat_ctx=llm.ChatContext.empty(), tools=[])
            assert await asyncio.wait_for(s.wait_ready(), 10)
            # One session open on a two-session engine is half its capacity, whatever the worker's CPU.
            assert await load.aload() == [0.5, 1.0][i]
        await model.aclose()
        assert await load.aload() == 0.0
    finally:
        load.close()
    # An engine that cannot be reached must not be offered calls.
    gone = EngineOccupancy(engine_address="unix:/nonexistent/engine.sock", timeout_s=0.5)
    assert gone.load() == 1.0
    gone.close()


# --- simulated jobs -------------------------------------------------------------------------------------------


@dataclass
class JobAudio:
    """What a simulated job heard and played, readable from the test's thread."""

    rate: int
    #: The caller's codec on the phone line ("pcmu"/"pcma"), or None for a room participant's PCM.
    g711: str | None = None
    mics: list[Mic] = field(default_factory=list)
    speakers: list[Speaker] = field(default_factory=list)
    #: Per job: a real room carrying the handlers the agent registered, the job's loop, the job's room name.
    rooms: list[tuple[rtc.Room, asyncio.AbstractEventLoop, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def loud_seconds(self) -> float:
        with self.lock:
            return sum(s.loud_seconds() for s in self.speakers)


JOB_AUDIO: dict[str, JobAudio] = {}


G711: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[bytes], np.ndarray]]] = {
    "pcmu": (ulaw_encode, ulaw_decode),
    "pcma": (alaw_encode, alaw_decode),
}


def caller_tone(audio: JobAudio) -> np.ndarray:
    """1 s of 300 Hz at the job's rate; on a phone line, what the caller's G.711 payloads decode to."""
    t = np.arange(audio.rate) / audio.rate
    pcm = (0.3 * np.sin(2 * np.pi * 300 * t) * 32767).astype(np.int16)
    if audio.g711 is None:
        return pcm
    encode, decode = G711[audio.g711]
    payload = encode(pcm).tobytes()  # one byte per sample: what the SIP trunk carries
    assert len(payload) == pcm.shape[0]
    return decode(payload)


def job_io(ctx: JobContext, *, key: str) -> SessionIO:
    """Runs inside the job (its own thread and loop): caller audio is a 1 s tone at the job's rate."""
    audio = JOB_AUDIO[key]
    mic, speaker = Mic(audio.rate), Speaker()
    mic.say(caller_tone(audio))
    with audio.lock:
        audio.mics.append(mic)
        audio.speakers.append(speaker)
        audio.rooms.append((real_room_with_handlers_of(ctx.room), asyncio.get_running_loop(), ctx.room.name))
    return mic, speaker


def real_room_with_handlers_of(job_room: rtc.Room) -> rtc.Room:
    """The simulated job's room is LiveKit's autospec mock (livekit/agents/ipc/mock_room.py), which records the
    handlers the agent registers but never calls them. This moves them onto a real, unconnected ``rtc.Room``, so
    a room event the test feeds it goes through the SDK's own dispatch (``Room._on_room_event``: FFI event →
    participant objects → ``emit``) to the agent's handlers."""
    room = rtc.Room()
    for call in job_room.on.call_args_list:  # type: ignore[attr-defined]
        room.on(*call.args)
    return room


def worker_status(server: AgentServer) -> dict[str, object]:
    # An explicit port: with 0 the IPv4 and IPv6 listeners get different ports and LiveKit reports one of them.
    url = f"http://127.0.0.1:{server.worker_info.http_port}/worker"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


async def run_simulated_job(
    server: AgentServer,
    audio: JobAudio,
    client: EngineClient,
    during: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run one simulated job until its agent plays the engine's audio; ``during`` runs while the job is live."""
    started = asyncio.Event()
    server.on("worker_started", lambda: started.set())
    run = asyncio.create_task(server.run(devmode=True, unregistered=True))
    try:
        await asyncio.wait_for(started.wait(), 30)
        await server.simulate_job("test-room", fake_job=True, agent_identity="omni-agent")
        deadline = time.monotonic() + 30
        while audio.loud_seconds() < 0.8:
            assert time.monotonic() < deadline, "the job's agent never played the engine's audio"
            assert not run.done(), run
            await asyncio.sleep(0.1)
        # The worker's own status (what it reports to LiveKit) carries the engine occupancy: 1 of 2 sessions.
        deadline = time.monotonic() + 10
        while (status := await asyncio.to_thread(worker_status, server)).get("worker_load") != 0.5:
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.25)
        assert status["active_jobs"] == 1
        assert (await client.ping()).active_sessions == 1
        if during is not None:
            await during()
    finally:
        await server.aclose()
        await asyncio.wait_for(run, 30)
    # Shutting the job down closed its session (and the model): the engine slot is free again.
    deadline = time.monotonic() + 10
    while (await client.ping()).active_sessions != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)


async def test_simulated_job_runs_the_room_agent_offline(
    engine: EngineProcess, client: EngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIVEKIT_OMNI_ENGINE_ADDRESS", engine.address)
    monkeypatch.delenv("LIVEKIT_OMNI_BASE_URL", raising=False)
    JOB_AUDIO["room"] = audio = JobAudio(rate=48_000)
    server = room_agent.build_server(
        session_io=functools.partial(job_io, key="room"),
        job_executor_type=JobExecutorType.THREAD,
        port=free_port(),
    )
    assert isinstance(server.load_fnc, EngineOccupancy) and server.load_fnc.engine_address == engine.address
    await run_simulated_job(server, audio, client)
    assert audio.mics and audio.mics[0].frames > 50


def sip_caller_events() -> list[proto_room.RoomEvent]:
    """What LiveKit sends the agent's room when a SIP caller joins and presses 5: a SIP participant with the
    call's attributes, then a ``sip_dtmf`` data packet from that participant (the FFI's own event messages)."""
    caller = proto_participant.OwnedParticipant(
        info=proto_participant.ParticipantInfo(
            sid="PA_caller",
            identity="sip_+15550100",
            kind=proto_participant.ParticipantKind.PARTICIPANT_KIND_SIP,
            attributes={
                "sip.callID": "SCL_test",
                "sip.phoneNumber": "+15550100",
                "sip.trunkPhoneNumber": "+15550199",
            },
        )
    )
    dtmf = proto_room.DataPacketReceived(
        participant_identity="sip_+15550100", sip_dtmf=proto_room.SipDTMF(code=5, digit="5")
    )
    return [
        proto_room.RoomEvent(participant_connected=proto_room.ParticipantConnected(info=caller)),
        proto_room.RoomEvent(data_packet_received=dtmf),
    ]


@pytest.mark.parametrize("g711", ["pcmu", "pcma"])
async def test_simulated_sip_call_g711_at_8khz_and_dtmf_room_event(
    engine: EngineProcess,
    client: EngineClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    g711: str,
) -> None:
    """A phone call: the caller's audio is G.711 (µ-law or A-law payloads at 8 kHz, decoded by media/codecs.py as
    LiveKit SIP decodes them before publishing the caller's track, which cannot run here), and the keypad press
    arrives as the room event LiveKit delivers (``sip_dtmf`` data packet) through the room's own event dispatch,
    so the agent's registered handlers, not a direct call, log it."""
    monkeypatch.setenv("LIVEKIT_OMNI_ENGINE_ADDRESS", engine.address)
    monkeypatch.delenv("LIVEKIT_OMNI_BASE_URL", raising=False)
    # No greeting: the echo engine would answer it with silence, and the test listens for the caller's echo.
    monkeypatch.setenv("LIVEKIT_OMNI_AGENT_GREETING", "")
    monkeypatch.delenv("LIVEKIT_OMNI_AGENT_NAME", raising=False)
    JOB_AUDIO["sip"] = audio = JobAudio(rate=8_000, g711=g711)
    server = sip_agent.build_server(
        session_io=functools.partial(job_io, key="sip"),
        job_executor_type=JobExecutorType.THREAD,
        port=free_port(),
    )
    # Phone calls are dispatched explicitly (by the SIP dispatch rule), by this name.
    assert AgentSettings.from_env(sip_agent.DEFAULTS).agent_name == "omni-sip"

    async def press_five() -> None:
        with audio.lock:
            room, loop, _ = audio.rooms[0]
        for ev in sip_caller_events():
            loop.call_soon_threadsafe(room._on_room_event, ev)
        deadline = time.monotonic() + 5
        while "DTMF" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)

    with caplog.at_level(logging.INFO, logger="livekit_omni.agents.sip"):
        await run_simulated_job(server, audio, client, during=press_five)
    room_name = audio.rooms[0][2]
    assert f"call SCL_test from +15550100 to +15550199 in {room_name}" in caplog.text
    assert f"DTMF '5' (code 5) from +15550100 in {room_name}" in caplog.text
    # Narrowband G.711 in, the engine's 24 kHz out: the caller's 300 Hz tone came back at its pitch and level.
    with audio.lock:
        played = np.concatenate(
            [np.frombuffer(f.data, np.int16) for _, f in audio.speakers[0].frames]
        ).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(played))
    assert abs(np.fft.rfftfreq(played.shape[0], 1 / 24_000)[spectrum.argmax()] - 300) < 5
    sent = caller_tone(audio).astype(np.float64)
    frames = played[: played.shape[0] // 480 * 480].reshape(-1, 480)
    loud = frames[np.sqrt((frames**2).mean(axis=1)) > 1000]
    assert loud.shape[0] >= 40  # at least 0.8 s of the 1 s tone
    level_db = 20 * np.log10(np.sqrt((loud**2).mean()) / np.sqrt((sent**2).mean()))
    assert abs(level_db) < 1.5, level_db


def test_worker_drain_uses_the_drain_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """LiveKit's worker drain (SIGTERM: no new jobs, running ones get ``drain_timeout``) takes the same grace as
    the server's own drain, instead of LiveKit's hour-long default that no container stop would wait out."""
    assert room_agent.build_server(load_fnc=lambda: 0.0, port=free_port())._drain_timeout == 30
    monkeypatch.setenv("LIVEKIT_OMNI_DRAIN_GRACE_S", "12")
    # AgentServer keeps it private; AgentServer.drain() reads it when no timeout is passed.
    assert sip_agent.build_server(load_fnc=lambda: 0.0, port=free_port())._drain_timeout == 12
