"""The vLLM-Omni bridge adapter (``engine.adapter = "omni_bridge"``) against a stand-in sidecar.

No GPU here, so the sidecar is ``testkit.omni_standin``: a process that speaks vLLM-Omni 0.30's duplex
WebSocket dialect (``/v1/realtime?duplex=1``) with a scripted model instead of a real one (a tone for a voice, an
energy gate for its turn-taking). It was derived from the vllm-omni 0.30.0 wheel's server handler
(``entrypoints/duplex/serving.py``) and event projection (``engine/duplex/realtime_events.py``), and checked against
the wheel's own code: ``vllm_omni.clients.duplex.DuplexClient`` and ``vllm_omni.protocol.duplex.events`` import
without a GPU when the package ``__init__`` (which imports torch and vllm) is bypassed, and the wheel's client drove
the stand-in through a handshake, two spoken turns, ``playback.ack``, ``barge_in`` (a cancelled ``response.done``
carrying ``audio.cancelled``), a dropped socket resumed with its token, model-initiated speech and a capacity
refusal, while every event type it received had exactly the keys the wheel's event class renders
(docs/omni-models.md, "The stand-in", has the script and its output). The wire itself is tested against the
wheel's own server handler in tests/test_omni_bridge_real.py; the stand-in is for what that cannot be made to do on
demand (a crash, the model's overlap policy, echo).

Everything else is real: ``livekit-omni serve`` with its engine process running the bridge adapter, the Live
WebSocket and WebRTC facades, the rings, and (tests/engine_driver.py) a media-plane stand-in that plays the egress
ring at real time and reports the playout position, so ``playback.ack`` carries what was actually played.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from livekit_omni.live import wire
from media.webrtc import enable_loopback_ice
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import (
    ROOT,
    ServerProcess,
    connect_engine,
    free_port,
    spawn_engine,
    start_server,
    wait_until_healthy,
)
from tests.engine_driver import SessionDriver, dominant_hz, silence, speech, turn_played_ms

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): a sidecar stand-in and its crashes.
pytestmark = pytest.mark.slow

REPLY_MS = 1200
TONE_HZ = 660.0


class Standin:
    """A stand-in sidecar process (``python -m testkit.omni_standin``) on a fixed port."""

    def __init__(self, **opts: object) -> None:
        self.port = free_port()
        self.opts = {"reply_ms": REPLY_MS, "tone_hz": TONE_HZ, **opts}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = ROOT / "test-output" / f"omni-standin-{self.port}.log"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> Standin:
        args = [sys.executable, "-m", "testkit.omni_standin", "--port", str(self.port)]
        for k, v in self.opts.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as logf:
            self.proc = subprocess.Popen(args, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
        wait_until_healthy(
            f"http://127.0.0.1:{self.port}/health",
            self.proc,
            timeout=30,
            what="the stand-in",
            log=self.log,
            poll_s=0.1,
        )
        return self

    def kill(self) -> None:
        """A crash: SIGKILL, no goodbye on any socket."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def state(self) -> dict[str, Any]:
        return json.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{self.port}/standin/state", timeout=5).read()
        )

    def post(self, path: str) -> dict[str, Any]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method="POST")
        return json.loads(urllib.request.urlopen(req, timeout=5).read())

    def session(self, sid: str | None = None) -> dict[str, Any]:
        sessions = self.state()["sessions"]
        return next(s for s in sessions if s["id"] == sid) if sid else sessions[-1]


def bridge_settings(standin: Standin, **overrides: object) -> dict[str, object]:
    return {"url": standin.url, "resume_window_s": 1.5, "ack_interval_ms": 50, **overrides}


def bridge_env(standin: Standin, **overrides: object) -> dict[str, str]:
    return {
        f"LIVEKIT_OMNI_ENGINE__OMNI_BRIDGE__{k.upper()}": str(v)
        for k, v in bridge_settings(standin, **overrides).items()
    }


def loud_seconds(pcm: np.ndarray, rate: int, threshold: float = 1000.0) -> float:
    n = rate // 50
    frames = pcm[: len(pcm) // n * n].astype(np.float64).reshape(-1, n)
    return float((np.sqrt((frames**2).mean(axis=1)) > threshold).sum()) * 0.02


# --- the served stack: one stand-in and one server for the Live tests ------------------------------------------


@pytest.fixture(scope="module")
def standin() -> Iterator[Standin]:
    s = Standin(max_sessions=2, overlap_barge_in_ms=200).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server(standin: Standin) -> Iterator[ServerProcess]:
    enable_loopback_ice()
    s = start_server(
        adapter="omni_bridge",
        env={**bridge_env(standin), "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true"},
        ready_timeout=60,
    )
    yield s
    s.stop()


def health(server: ServerProcess) -> dict[str, Any]:
    return json.loads(urllib.request.urlopen(server.url + "/health", timeout=5).read())


def test_health_reports_model_owned_turn_taking_as_capability_data(server: ServerProcess) -> None:
    eng = health(server)["engine"]
    assert eng["adapter"] == "omni_bridge"
    assert eng["capabilities"] == {
        "owns_turn_taking": True,
        "barge_in": True,
        "resident_kv": False,
        "exact_rollback": False,
        "text_completions": False,  # no LLM of ours: /v1/chat/completions answers 400 on this adapter
        "tools": False,  # vLLM-Omni's duplex endpoint runs no function tools: a session with tools is refused
    }
    omni = eng["omni"]
    assert omni["preset"] == "minicpmo_4_5" and omni["sidecar"] == "up"
    assert omni["input"] == {"format": "pcm16", "rate": 16000, "unit_ms": 1000}


async def live_session(server: ServerProcess) -> tuple[LiveClient, wire.SessionStarted]:
    c = await LiveClient.connect(server.url, api_key=None)
    ev = await c.start({"model": "omni", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}})
    assert isinstance(ev, wire.SessionStarted), ev
    return c, ev


async def test_spoken_exchange_over_the_live_websocket(server: ServerProcess, standin: Standin) -> None:
    c, started = await live_session(server)
    try:
        caps = started.session.capabilities
        assert caps is not None and caps["owns_turn_taking"] and caps["barge_in"]
        # 600 ms of speech, then quiet: the model (not us) decides the turn is over and answers.
        pcm = np.concatenate([speech(600, 24_000), silence(1500, 24_000)])
        await c.append_audio(pcm.astype("<i2").tobytes(), bytes_per_100ms=4800)
        heard = await c.next_event(wire.InputTranscriptDelta, 10)
        said_ms = int(heard.delta.removeprefix("heard ").removesuffix(" ms"))
        assert abs(said_ms - 600) <= 40, heard.delta
        for _ in range(100):  # the reply streams in at real time
            if loud_seconds(np.frombuffer(bytes(c.audio), dtype="<i2"), 24_000) >= REPLY_MS / 1000:
                break
            await asyncio.sleep(0.1)
        out = np.frombuffer(bytes(c.audio), dtype="<i2")
        assert abs(loud_seconds(out, 24_000) - REPLY_MS / 1000) <= 0.04
        assert abs(dominant_hz(out, 24_000) - TONE_HZ) < 5
        texts: list[str] = []
        while len(texts) < 15:
            texts.append((await c.next_event(wire.OutputTranscriptDelta, 5)).delta)
        assert "".join(texts).split() == [f"w{i}" for i in range(15)]
        # Up at the model's native unit (1 s for MiniCPM-o), in its format; playout acked back to the model.
        await asyncio.sleep(0.5)
        st = standin.session()
        assert st["input_format"] == "pcm16" and st["input_rate"] == 16000
        assert st["appends"] >= 2 and st["received_ms"] == st["appends"] * 1000
        played = [a["played_ms"] for a in st["acks"]]
        assert played == sorted(played) and played[-1] == REPLY_MS
        assert st["barge_ins"] == [] and st["commits"] == 0  # the model owns turn-taking: we never commit
    finally:
        await c.close()


async def test_spoken_exchange_over_webrtc(server: ServerProcess, standin: Standin) -> None:
    t = np.arange(int(0.6 * 48_000)) / 48_000
    said = (8000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16)
    # The clip ends in its own silence: the caller's Opus encoder then idles on silence, not on the tone's state.
    clip = np.concatenate([np.zeros(24_000, np.int16), said, np.zeros(3 * 48_000, np.int16)])
    caller = WebRTCCaller(clip, loop=False)
    try:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            body = {
                "session": {"model": "omni"},
                "transport": {"type": "webrtc", "sdp": await caller.offer()},
            }
            async with http.post(server.url + "/v1/live/sessions", json=body) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
        await caller.accept(answer["transport"]["sdp"])
        await asyncio.wait_for(caller.opened.wait(), 10)
        deadline = time.monotonic() + 15
        events: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            while caller.messages:
                events.append(json.loads(caller.messages.popleft()))
            rate = caller.rate
            if rate and loud_seconds(caller.received_audio(), rate) >= REPLY_MS / 1000 - 0.1:
                break
            await asyncio.sleep(0.1)
        started = next(e for e in events if e["type"] == "session.started")
        assert started["session"]["capabilities"]["owns_turn_taking"] is True
        assert any(
            e["type"] == "session.input_transcript.delta" and e["delta"].startswith("heard") for e in events
        ), [e["type"] for e in events]
        out = caller.received_audio()
        assert abs(loud_seconds(out, caller.rate) - REPLY_MS / 1000) <= 0.2
        loud = out[np.abs(out) > 2000]
        assert loud.size and abs(dominant_hz(out[-int(caller.rate * 1.5) :], caller.rate) - TONE_HZ) < 10
    finally:
        await caller.close()


async def test_refused_capacity_is_session_limit_reached(server: ServerProcess, standin: Standin) -> None:
    """The stand-in takes 2 sessions (its ``runtime.max_sessions``); the third open is its ``resource_exhausted``."""
    await asyncio.sleep(0.5)  # sessions of earlier tests close on the sidecar
    a, _ = await live_session(server)
    b, _ = await live_session(server)
    c = await LiveClient.connect(server.url, api_key=None)
    try:
        ev = await c.start({"model": "omni"})
        assert isinstance(ev, wire.Error) and ev.error.code == "session_limit_reached", ev
        assert "full" in ev.error.message and "resource_exhausted" in ev.error.message
        await c.wait_closed()
        assert standin.state()["refused"] >= 1
        assert health(server)["engine"]["omni"]["refused"] >= 1
    finally:
        for x in (a, b, c):
            await x.close()


# --- engine-level: barge-in, epochs, playout, resume, crash ----------------------------------------------------


@contextlib.asynccontextmanager
async def bridged(
    standin_opts: dict[str, object] | None = None, **settings: object
) -> AsyncIterator[tuple[Standin, EngineClient]]:
    """A fresh stand-in and a real engine process bridged to it (its control client, models loaded)."""
    standin = Standin(**(standin_opts or {})).start()
    eng = spawn_engine(adapter="omni_bridge", omni_bridge=bridge_settings(standin, **settings))
    client = None
    try:
        client = await connect_engine(eng, ready_timeout=60)
        yield standin, client
    finally:
        if client is not None:
            await client.close()
        eng.stop()
        standin.stop()


@pytest.fixture
async def bridge_engine() -> AsyncIterator[tuple[Standin, EngineClient]]:
    async with bridged() as pair:
        yield pair


async def test_the_models_barge_in_bumps_our_epoch_and_keeps_what_was_played() -> None:
    async with bridged({"overlap_barge_in_ms": 200}) as (standin, client):
        await _model_barge_in(standin, client)


async def _model_barge_in(standin: Standin, client: EngineClient) -> None:
    s = await client.open_session(p.SessionConfig())
    d = SessionDriver(s)
    try:
        # The caller asks; once ~500 ms of the answer has played they talk over it (the model's overlap policy
        # cuts it off after 200 ms of overlap).
        await d.run(np.concatenate([speech(600), silence(400)]), until=lambda x: turn_played_ms(x, 1) >= 500)
        await d.run(speech(600), until=lambda x: bool(x.of(p.ReplyDone)))
        await d.run(seconds=0.4)
        barge = d.of(p.BargeIn)[0]
        done = d.of(p.ReplyDone)[0]
        assert done.interrupted and done.turn_id == barge.turn_id == 1
        # Our epoch: bumped once, by us, when the model's audio.cancelled arrived; the ring carries it.
        assert barge.epoch == 1 and [e for _, e in d.epoch_changes] == [1]
        played_ms = turn_played_ms(d, 1)
        assert 500 <= played_ms < REPLY_MS - 100
        # The model's side: its epoch advanced, and what it committed is the played position we acked.
        st = standin.session()
        (cut,) = st["barge_ins"]
        assert cut["reason"] == "overlap_barge_in" and st["epoch"] == 1
        assert abs(cut["committed_ms"] - barge.played_samples / 24) <= 60
        assert abs(cut["committed_ms"] - played_ms) <= 100
        # The played words stay in the reply text: those whose audio had played.
        assert done.text.split() == [f"w{i}" for i in range(len(done.text.split()))]
        assert 80 * (len(done.text.split()) - 1) <= played_ms
        # Nothing of the cut turn plays after the fence went up.
        t_fence = d.epoch_changes[0][0]
        assert not [x for x in d.played if x.turn_id == 1 and x.wall > t_fence + 0.03]
    finally:
        await s.close()


async def test_our_interrupt_acks_the_played_position_then_barges_in(
    bridge_engine: tuple[Standin, EngineClient],
) -> None:
    standin, client = bridge_engine
    s = await client.open_session(p.SessionConfig())
    d = SessionDriver(s)
    try:
        await d.run(np.concatenate([speech(600), silence(400)]), until=lambda x: turn_played_ms(x, 1) >= 400)
        interrupted = await s.interrupt()
        assert interrupted.epoch == 1
        await d.run(seconds=0.5)
        played_ms = turn_played_ms(d, 1)
        st = standin.session()
        (cut,) = st["barge_ins"]
        assert cut["reason"] == "barge_in" and st["epoch"] == 1
        # The ack of the played position went up before barge_in, so the model committed exactly that.
        assert abs(cut["committed_ms"] - played_ms) <= 60
        done = d.of(p.ReplyDone)[0]
        assert done.interrupted and not d.of(p.BargeIn)  # a client interrupt, not a caller barge-in
        # The next exchange runs in our new epoch and plays in full.
        await d.run(np.concatenate([speech(600), silence(400)]), until=lambda x: x.reply_done(2), seconds=1.0)
        second = next(e for e in d.of(p.ReplyStarted) if e.turn_id == 2)
        assert second.epoch == 1
        assert abs(turn_played_ms(d, 2) - REPLY_MS) <= 40
    finally:
        await s.close()


async def test_the_safety_net_cuts_a_model_that_talks_over_the_caller() -> None:
    """A model whose overlap handling never yields (the stand-in without its overlap policy): with the preset's
    ``barge_in_after_ms`` our side hears the caller over it, fences, and sends the played position + ``barge_in``."""
    preset = {"input_unit_ms": 200, "barge_in_after_ms": 300}
    async with bridged(preset="net", presets={"net": preset}) as (standin, client):
        s = await client.open_session(p.SessionConfig())
        d = SessionDriver(s)
        try:
            await d.run(
                np.concatenate([speech(600), silence(400)]), until=lambda x: turn_played_ms(x, 1) >= 400
            )
            await d.run(speech(600), until=lambda x: bool(x.of(p.ReplyDone)))
            await d.run(seconds=0.4)
            barge, done = d.of(p.BargeIn)[0], d.of(p.ReplyDone)[0]
            assert barge.epoch == 1 and [e for _, e in d.epoch_changes] == [1]
            assert done.interrupted and done.turn_id == barge.turn_id == 1
            (cut,) = standin.session()["barge_ins"]
            assert cut["reason"] == "barge_in"
            assert abs(cut["committed_ms"] - turn_played_ms(d, 1)) <= 60
            t_fence = d.epoch_changes[0][0]
            assert not [x for x in d.played if x.turn_id == 1 and x.wall > t_fence + 0.03]
        finally:
            await s.close()


async def test_model_initiated_speech(bridge_engine: tuple[Standin, EngineClient]) -> None:
    standin, client = bridge_engine
    s = await client.open_session(p.SessionConfig())
    d = SessionDriver(s)
    try:
        await d.run(seconds=0.3)
        assert standin.post("/standin/speak")["spoke"]
        await d.run(until=lambda x: x.reply_done(1), seconds=0.5)
        assert not d.of(p.SpeechStarted) and not d.of(p.InputTranscript)  # the caller said nothing
        assert abs(turn_played_ms(d, 1) - REPLY_MS) <= 40
        assert abs(dominant_hz(d.audio_of_turn(1), 24_000) - TONE_HZ) < 5
    finally:
        await s.close()


async def test_a_dropped_bridge_socket_resumes_the_same_session(
    bridge_engine: tuple[Standin, EngineClient],
) -> None:
    standin, client = bridge_engine
    s = await client.open_session(p.SessionConfig())
    d = SessionDriver(s)
    try:
        await d.run(np.concatenate([speech(600), silence(400)]), until=lambda x: turn_played_ms(x, 1) >= 300)
        sid = standin.session()["id"]
        assert standin.post("/standin/drop")["dropped"] == [sid]
        await d.run(until=lambda x: x.reply_done(1), seconds=0.5)
        st = standin.session(sid)
        assert st["resumes"] == 1 and st["attached"] and not st["closed"]
        # The reply the model went on producing while we were away came back from its journal, whole.
        done = d.of(p.ReplyDone)[0]
        assert not done.interrupted and done.total_samples == REPLY_MS * 24
        assert not d.of(p.SessionError)
        stats = await client.ping()
        assert stats.flat()["omni"]["resumes"] == 1
    finally:
        await s.close()


async def test_a_sidecar_crash_ends_sessions_with_a_typed_error_and_a_restart_serves_new_ones(
    bridge_engine: tuple[Standin, EngineClient],
) -> None:
    standin, client = bridge_engine
    s = await client.open_session(p.SessionConfig())
    d = SessionDriver(s)
    await d.run(np.concatenate([speech(600), silence(400)]), until=lambda x: turn_played_ms(x, 1) >= 200)
    standin.kill()
    t0 = time.monotonic()
    await d.run(until=lambda x: x.session.closed, seconds=0.1)
    while not s.events.empty():  # the driver stops reading once the session is closed
        d.events.append((time.monotonic(), s.events.get_nowait()))
    (err,) = d.of(p.SessionError)
    assert err.code == "sidecar_lost" and err.fatal
    assert d.of(p.SessionClosed)[0].reason == "sidecar_lost"
    assert time.monotonic() - t0 < 1.5 + 2.0  # the resume window, then the end
    # A restarted sidecar (same port) serves new sessions through the same engine.
    standin.start()
    s2 = await client.open_session(p.SessionConfig())
    d2 = SessionDriver(s2)
    try:
        await d2.run(
            np.concatenate([speech(600), silence(400)]), until=lambda x: x.reply_done(1), seconds=1.0
        )
        assert abs(turn_played_ms(d2, 1) - REPLY_MS) <= 40
    finally:
        await s2.close()


async def test_the_live_websocket_sees_a_sidecar_crash_as_a_typed_error(standin_crash_server: Any) -> None:
    standin, server = standin_crash_server
    c, _ = await live_session(server)
    try:
        await c.append_audio(speech(300, 24_000).astype("<i2").tobytes(), bytes_per_100ms=4800)
        standin.kill()
        ev = await c.next_event(wire.Error, 10)
        assert ev.error.code == "sidecar_lost" and ev.error.type == "server_error"
        closed = await c.next_event(wire.SessionClosed, 5)
        assert closed.reason == "connection_lost"
    finally:
        await c.close()


@pytest.fixture
def standin_crash_server() -> Iterator[tuple[Standin, ServerProcess]]:
    standin = Standin().start()
    server = start_server(adapter="omni_bridge", env=bridge_env(standin), ready_timeout=60)
    try:
        yield standin, server
    finally:
        server.stop()
        standin.stop()


def test_presets_carry_each_model_familys_wire_format() -> None:
    from engine_bridge.config import OmniBridgeSettings

    presets = OmniBridgeSettings().presets
    assert {"minicpmo_4_5", "qwen3_omni", "personaplex", "nemotron_voicechat"} <= set(presets)
    assert (presets["personaplex"].input_format, presets["personaplex"].input_rate) == ("pcm_f32le", 24_000)
    assert (
        presets["nemotron_voicechat"].output_rate == 22_050
        and presets["nemotron_voicechat"].input_unit_ms == 80
    )
    assert not presets["qwen3_omni"].owns_turn_taking
    with pytest.raises(ValueError, match="unknown omni preset"):
        OmniBridgeSettings(preset="nope").resolved_preset()


async def test_a_model_without_its_own_turns_gets_our_commit_and_float_input() -> None:
    """Nemotron-like wire (16 kHz float32 up in 80 ms frames, 22.05 kHz down) on a model that turns on commits."""
    async with bridged(
        {"turns": "commit", "output_rate": 22_050}, preset="custom", presets={"custom": _custom_preset()}
    ) as (standin, client):
        assert (await client.ping()).flat()["capabilities"]["owns_turn_taking"] is False
        s = await client.open_session(p.SessionConfig())
        d = SessionDriver(s)
        try:
            await d.run(
                np.concatenate([speech(600), silence(800)]), until=lambda x: x.reply_done(1), seconds=1.0
            )
            st = standin.session()
            assert st["commits"] == 1 and st["input_format"] == "pcm_f32le" and st["input_rate"] == 16000
            assert st["received_ms"] == st["appends"] * 80
            # 22.05 kHz from the model, 24 kHz in our egress: the same duration, the same tone.
            assert abs(turn_played_ms(d, 1) - REPLY_MS) <= 40
            assert abs(dominant_hz(d.audio_of_turn(1), 24_000) - TONE_HZ) < 5
        finally:
            await s.close()


def _custom_preset() -> dict[str, object]:
    return {
        "input_format": "pcm_f32le",
        "input_rate": 16_000,
        "input_unit_ms": 80,
        "output_rate": 22_050,
        "owns_turn_taking": False,
        "barge_in": False,
    }


def test_b64_helper_is_plain_base64() -> None:
    from engine_bridge.adapters.omni import dialect

    pcm = np.array([0.5, -0.5], dtype=np.float32)
    assert base64.b64decode(dialect.encode_input(pcm, "pcm16")) == np.array([16384, -16384], "<i2").tobytes()
    assert np.frombuffer(base64.b64decode(dialect.encode_input(pcm, "pcm_f32le")), "<f4").tolist() == [
        0.5,
        -0.5,
    ]


# --- the LiveKit plugin, co-located ----------------------------------------------------------------------------


async def test_the_livekit_plugin_colocated_drives_a_session_through_the_bridge() -> None:
    """A real ``AgentSession`` on ``OmniDuplexModel`` in co-located mode (shared-memory rings, local control
    channel) against a real engine running the bridge; in-memory microphone and speaker (tests/plugin_harness.py),
    only LiveKit's room is left out (it needs a LiveKit server)."""
    from livekit_omni import OmniDuplexModel
    from livekit_omni.plugin.colocated import ColocatedSession
    from tests.plugin_harness import start_conversation

    async with bridged() as (standin, client):
        model = OmniDuplexModel(engine_address=_engine_address(client))
        conv = await start_conversation(model, rate=48_000, instructions="Be brief.")
        try:
            assert isinstance(conv.duplex, ColocatedSession)
            await conv.mic.say(speech(600, 48_000))
            await conv.rec.wait_for(
                lambda: any(not r.interrupted for r in conv.rec.of("duplex.omni_reply_done")),
                20,
                "the answer",
            )
            await conv.settle(quiet_s=0.5)
            # The caller's turn (the model's transcript) and the model's answer land in the chat history.
            users, answers = conv.texts("user"), conv.texts("assistant")
            assert users and users[-1].startswith("heard"), conv.rec.summary()
            assert answers and answers[-1].split() == [f"w{i}" for i in range(15)], conv.rec.summary()
            assert abs(conv.speaker.loud_seconds() - REPLY_MS / 1000) <= 0.1
            st = standin.session()
            assert st["acks"] and st["acks"][-1]["played_ms"] == REPLY_MS
            assert not conv.rec.of("duplex.error"), conv.rec.summary()
        finally:
            await conv.aclose()
            await model.aclose()
        assert (await client.ping()).active_sessions == 0


def _engine_address(client: EngineClient) -> str:
    return str(client.address)
