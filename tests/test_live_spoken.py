"""Spoken exchanges through the Live facade with the REAL engine (cascade: VAD → ASR → SmolLM2 → Piper).

These need the cascade adapter and its models (they load in ~10-20 s, once for the module). Every client is a
stock one: the openai SDK, LiveKit's ``GPTLiveModel`` inside a real ``AgentSession``, a G.711 µ-law telephony
client over the WebSocket, and an aiortc WebRTC caller. The caller's speech is Piper-synthesized
(tests/speech_fixtures.py), so every run hears the same audio.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
from livekit import rtc
from livekit.agents import Agent, AgentSession, utils
from livekit.agents.voice import io
from livekit.plugins.openai.realtime import GPTLiveModel
from openai import AsyncOpenAI

from livekit_omni.live import wire
from media.codecs import ulaw_decode, ulaw_encode
from media.webrtc import enable_loopback_ice
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import ServerProcess, start_server
from tests.plugin_harness import history_messages, wait_until
from tests.speech_fixtures import synthesize_speech

pytestmark = pytest.mark.models

API_KEY = "sk-test"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def cascade_server() -> Iterator[ServerProcess]:
    """One real-engine server for the whole module (model loading dominates)."""
    enable_loopback_ice()
    s = start_server(
        adapter="cascade",
        env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]), "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true"},
    )
    yield s
    s.stop()


def loud_ms(pcm: np.ndarray, rate: int, threshold: float = 500.0) -> list[int]:
    """Start (ms) of every 20 ms frame whose RMS is above ``threshold``."""
    n = rate // 50
    frames = pcm[: len(pcm) // n * n].astype(np.float64).reshape(-1, n)
    return [int(i) * 20 for i in np.nonzero(np.sqrt((frames**2).mean(axis=1)) > threshold)[0]]


def _metrics(server: ServerProcess) -> str:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def mentions(text: str, *words: str) -> bool:
    t = text.lower()
    return all(w.lower() in t for w in words)


# --- the openai SDK ---------------------------------------------------------------------------------------------


async def test_openai_sdk_spoken_exchange(cascade_server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{cascade_server.url}/v1", api_key=API_KEY)
    speech = synthesize_speech(QUESTION, rate=24000)
    mic = np.concatenate([speech, np.zeros(24000 * 12, np.int16)])  # the question, then the caller listens
    audio = bytearray()
    said: list[Any] = []
    heard: list[Any] = []
    async with client.live.connect() as conn:
        await conn.session.start(
            session={
                "model": "gpt-live-1",
                "instructions": "You are a helpful assistant. Answer in one short sentence.",
                "audio": {"format": {"type": "audio/pcm", "rate": 24000}},
            }
        )
        ev = await asyncio.wait_for(conn.recv(), 15)
        assert ev.type == "session.started"

        async def speak() -> None:
            t0 = time.monotonic()
            for i, pos in enumerate(range(0, len(mic), 2400)):
                chunk = mic[pos : pos + 2400].astype("<i2").tobytes()
                await conn.session.input_audio.append(audio=base64.b64encode(chunk).decode())
                await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.1 - time.monotonic()))

        speaker = asyncio.create_task(speak())
        try:
            deadline = time.monotonic() + 40
            answer_done_at: float | None = None
            while time.monotonic() < deadline:
                ev = await asyncio.wait_for(conn.recv(), 10)
                if ev.type == "session.output_audio.delta":
                    audio += base64.b64decode(ev.delta)
                elif ev.type == "session.input_transcript.delta":
                    said.append(ev)
                elif ev.type == "session.output_transcript.delta":
                    heard.append(ev)
                    answer_done_at = None
                elif ev.type == "error":
                    pytest.fail(f"error event: {ev}")
                if heard and answer_done_at is None:
                    answer_done_at = time.monotonic()
                if answer_done_at is not None and time.monotonic() - answer_done_at > 3:
                    break  # 3 s without new answer text: the reply is over
        finally:
            speaker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await speaker
        await conn.session.close()
        closed = None
        async for ev in conn:
            if ev.type == "session.closed":
                closed = ev
    assert closed is not None and closed.reason == "close_requested"

    caller_text = " ".join(e.delta for e in said)
    answer = "".join(e.delta for e in heard)
    assert mentions(caller_text, "capital", "France"), caller_text
    assert "paris" in answer.lower(), answer
    # Transcript ids are unique, times integer and non-decreasing.
    for events in (said, heard):
        assert len({e.event_id for e in events}) == len(events)
        starts = [e.start_ms for e in events]
        assert starts == sorted(starts) and all(e.end_ms >= e.start_ms for e in events)
    # The answer audio is there, and its transcript is stamped where that audio plays on the output timeline
    # (the client receives every output frame from the session's start, so byte offset = timeline position).
    out = np.frombuffer(bytes(audio), dtype="<i2")
    loud = loud_ms(out, 24000)
    assert len(loud) * 20 >= 800, len(loud)
    first_word = heard[0].start_ms
    speech_near = [t for t in loud if abs(t - first_word) <= 400]
    assert speech_near, (first_word, loud[:10])
    assert heard[0].start_ms > said[0].end_ms  # the answer follows the question
    # The turn's latency (caller stopped -> first answer audio) was measured.
    metrics = await asyncio.to_thread(_metrics, cascade_server)
    count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("livekit_omni_turn_latency_seconds_count")
    )
    assert count >= 1


# --- µ-law over the WebSocket (a telephony bridge) ----------------------------------------------------------------


async def test_pcmu_spoken_round_trip(cascade_server: ServerProcess) -> None:
    c = await LiveClient.connect(cascade_server.url, api_key=API_KEY)
    try:
        ev = await c.start({"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcmu", "rate": 8000}}})
        assert isinstance(ev, wire.SessionStarted), ev
        assert ev.session.audio.format == wire.AudioFormat(type="audio/pcmu", rate=8000)
        speech = synthesize_speech(QUESTION, rate=8000)
        mic = ulaw_encode(np.concatenate([speech, np.zeros(8000 * 12, np.int16)])).tobytes()
        speaker = asyncio.create_task(c.append_audio(mic, bytes_per_100ms=800))
        try:
            said = await c.next_event(wire.InputTranscriptDelta, timeout=20)
            heard = [await c.next_event(wire.OutputTranscriptDelta, timeout=25)]
            while True:  # the answer is over after 3 s without new text
                try:
                    heard.append(await c.next_event(wire.OutputTranscriptDelta, timeout=3))
                except TimeoutError:
                    break
        finally:
            speaker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await speaker
        await c.send({"type": "session.close"})
        await c.next_event(wire.SessionClosed)
        assert await c.wait_closed() == 1000
    finally:
        await c.close()
    assert mentions(said.delta, "capital", "France"), said
    assert "paris" in "".join(e.delta for e in heard).lower(), heard
    assert all(160 <= n <= 800 for _, n in c.deltas)  # 20-100 ms of 8 kHz µ-law
    out = ulaw_decode(bytes(c.audio))
    assert len(loud_ms(out, 8000)) * 20 >= 800


# --- LiveKit's stock GPTLiveModel inside a real AgentSession -------------------------------------------------


class Mic(io.AudioInput):
    def __init__(self) -> None:
        super().__init__(label="mic")
        self.ch: utils.aio.Chan[rtc.AudioFrame] = utils.aio.Chan()

    async def __anext__(self) -> rtc.AudioFrame:
        return await self.ch.__anext__()


class Speaker(io.AudioOutput):
    def __init__(self) -> None:
        super().__init__(label="speaker", capabilities=io.AudioOutputCapabilities(pause=False))
        self.played = 0.0
        self.pushed = 0.0

    async def capture_frame(self, frame: rtc.AudioFrame) -> None:
        await super().capture_frame(frame)
        self.pushed += frame.duration

    def flush(self) -> None:
        super().flush()
        d, self.pushed = self.pushed, 0.0
        self.played += d
        asyncio.get_running_loop().call_soon(
            lambda: self.on_playback_finished(playback_position=d, interrupted=False)
        )

    def clear_buffer(self) -> None:
        return None


async def _stream(mic: Mic, pcm: np.ndarray, stop: asyncio.Event) -> None:
    """Feed 20 ms frames at real time: ``pcm``, then silence until ``stop``."""
    n = 480
    t0 = time.monotonic()
    i = 0
    silence = np.zeros(n, np.int16)
    while not stop.is_set():
        part = pcm[i * n : (i + 1) * n] if i * n < len(pcm) else silence
        if len(part) < n:
            part = np.concatenate([part, silence[: n - len(part)]])
        mic.ch.send_nowait(rtc.AudioFrame(part.tobytes(), 24000, 1, n))
        i += 1
        await asyncio.sleep(max(0.0, t0 + i * 0.02 - time.monotonic()))


async def test_livekit_gpt_live_model_stock_defaults_two_turn_conversation(
    cascade_server: ServerProcess,
) -> None:
    """Stock ``GPTLiveModel(base_url=..., api_key=...)``, no other argument: its default ``responses`` delegation
    is accepted and the engine's own model answers both spoken turns."""
    model = GPTLiveModel(base_url=f"{cascade_server.url}/v1", api_key=API_KEY)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    stop = asyncio.Event()
    feeder: asyncio.Task[None] | None = None
    try:
        await session.start(
            agent=Agent(instructions="You are a helpful assistant. Answer in one short sentence.")
        )
        turns = [QUESTION, "How many legs does a spider have?"]
        for n, question in enumerate(turns, 1):
            stop.clear()
            feeder = asyncio.create_task(_stream(mic, synthesize_speech(question, rate=24000), stop))
            # The caller's words come back as a user message, then the model answers (an assistant message).
            await wait_until(lambda n=n: len(history_messages(session, "user")) >= n, 30)
            await wait_until(
                lambda n=n: len([m for m in history_messages(session, "assistant") if m.strip()]) >= n, 30
            )
            await asyncio.sleep(1.5)  # let the reply finish
            stop.set()
            await feeder
    finally:
        stop.set()
        if feeder is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
        t0 = time.monotonic()
        await session.aclose()
        close_s = time.monotonic() - t0
        await model.aclose()
    users = history_messages(session, "user")
    assistants = [m for m in history_messages(session, "assistant") if m.strip()]
    assert mentions(users[0], "capital", "France"), users
    assert mentions(users[1], "spider"), users
    # Each turn's answer, in order: SmolLM2-135M (greedy) knows both facts.
    assert len(assistants) >= 2, assistants
    assert "paris" in assistants[0].lower(), assistants
    assert mentions(assistants[1], "legs") and (mentions(assistants[1], "eight") or "8" in assistants[1]), (
        assistants
    )
    assert speaker.played > 1.0
    assert close_s < 5.0, close_s


# --- WebRTC ---------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _webrtc_call(
    server: ServerProcess, audio: np.ndarray
) -> AsyncIterator[tuple[WebRTCCaller, dict[str, Any]]]:
    import aiohttp

    caller = WebRTCCaller(audio, loop=False)
    try:
        body = {
            "session": {"model": "gpt-live-1"},
            "transport": {"type": "webrtc", "sdp": await caller.offer()},
        }
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                server.url + "/v1/live/sessions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
            ) as r,
        ):
            assert r.status == 200, await r.text()
            answer = await r.json()
        await caller.accept(answer["transport"]["sdp"])
        await asyncio.wait_for(caller.opened.wait(), 10)
        yield caller, answer
    finally:
        await caller.close()


async def test_webrtc_spoken_question_gets_answer_audio_on_the_track(cascade_server: ServerProcess) -> None:
    speech = synthesize_speech(QUESTION, rate=48000, lead_silence_ms=800)
    events: list[dict[str, Any]] = []
    async with _webrtc_call(cascade_server, speech) as (caller, _answer):
        deadline = time.monotonic() + 40
        last_text = 0.0
        while time.monotonic() < deadline:
            while caller.messages:
                ev = json.loads(caller.messages.popleft())
                events.append(ev)
                if ev["type"] == "session.output_transcript.delta":
                    last_text = time.monotonic()
            if last_text and time.monotonic() - last_text > 3:
                break
            await asyncio.sleep(0.05)
        caller.send(json.dumps({"type": "session.close"}))
        await asyncio.sleep(0.5)
        while caller.messages:
            events.append(json.loads(caller.messages.popleft()))
        rate = caller.rate
        received = caller.received_audio()
    types = [e["type"] for e in events]
    assert types[0] == "session.started"
    said = " ".join(e["delta"] for e in events if e["type"] == "session.input_transcript.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "session.output_transcript.delta")
    assert mentions(said, "capital", "France"), said
    assert "paris" in answer.lower(), answer
    assert "session.closed" in types
    # Answer audio arrived on the track (Opus at 48 kHz).
    assert rate == 48000
    assert len(loud_ms(received, rate)) * 20 >= 800
