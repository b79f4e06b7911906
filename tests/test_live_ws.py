"""The OpenAI Live facade over the WebSocket, against a real ``livekit-omni serve`` with the loopback echo fixture.

One server for the module (API key ``sk-test``; small limits so the limit tests are quick). Every error path of
the protocol gets its own test, and each checks that the session survives when the protocol says it should.
The event log of this server feeds tests/test_zz_event_conformance.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from livekit_omni.live import wire
from media.codecs import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess, start_server

API_KEY = "sk-test"
MAX_MESSAGE = 512 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_LIMITS__MAX_MESSAGE_BYTES": str(MAX_MESSAGE),
            "LIVEKIT_OMNI_LIMITS__INPUT_BURST_S": "1.0",
            "LIVEKIT_OMNI_LIMITS__INPUT_BACKPRESSURE_GRACE_S": "1.0",
            "LIVEKIT_OMNI_LIMITS__MAX_FIXTURE_S": "2",
        },
    )
    yield s
    s.stop()


# --- helpers ----------------------------------------------------------------------------------------------------


def tone(seconds: float, rate: int, freq: float = 440.0, amp: float = 8000.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.int16)


FORMATS: dict[str, tuple[dict[str, Any], int, int]] = {
    # name: (audio.format, rate, bytes per sample)
    "pcm16k": ({"type": "audio/pcm", "rate": 16000}, 16000, 2),
    "pcm24k": ({"type": "audio/pcm", "rate": 24000}, 24000, 2),
    "pcmu": ({"type": "audio/pcmu", "rate": 8000}, 8000, 1),
    "pcma": ({"type": "audio/pcma", "rate": 8000}, 8000, 1),
}


def encode(pcm: np.ndarray, name: str) -> bytes:
    if name == "pcmu":
        return ulaw_encode(pcm).tobytes()
    if name == "pcma":
        return alaw_encode(pcm).tobytes()
    return pcm.astype("<i2").tobytes()


def decode(raw: bytes, name: str) -> np.ndarray:
    if name == "pcmu":
        return ulaw_decode(raw)
    if name == "pcma":
        return alaw_decode(raw)
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


def loud_frames(pcm: np.ndarray, rate: int, threshold: float = 1000.0) -> np.ndarray:
    """Indices of 20 ms frames whose RMS exceeds ``threshold``."""
    n = rate // 50
    frames = pcm[: len(pcm) // n * n].astype(np.float64).reshape(-1, n)
    return np.nonzero(np.sqrt((frames**2).mean(axis=1)) > threshold)[0]


def dominant_hz(pcm: np.ndarray, rate: int) -> float:
    spec = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(len(pcm))))
    return float(np.fft.rfftfreq(len(pcm), 1 / rate)[int(np.argmax(spec))])


ACKS: dict[str, type[wire.AppendedEvent]] = {
    "instructions": wire.InstructionsAppended,
    "thinking": wire.ThinkingAppended,
    "commentary": wire.CommentaryAppended,
}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


async def started(server: ServerProcess, session: dict[str, Any] | None = None, **kw: Any) -> LiveClient:
    c = await LiveClient.connect(server.url, **kw)
    ev = await c.start(session)
    assert isinstance(ev, wire.SessionStarted), ev
    return c


async def expect_error(c: LiveClient, code: str, timeout: float = 5.0) -> wire.Error:
    ev = await c.next_event(wire.Error, timeout)
    assert ev.error.code == code, ev
    assert ev.error.type and ev.error.message and ev.event_id
    return ev


async def still_alive(c: LiveClient) -> None:
    """The session answers a command after an error: it survived."""
    await c.send({"type": "session.input_audio.mute", "event_id": "alive"})
    ev = await c.next_event(wire.InputAudioMuted)
    assert ev.client_event_id == "alive"
    assert not c.closed.is_set()


# --- auth -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["sk-wrong", None], ids=["wrong-key", "missing-key"])
async def test_bad_api_key_gets_error_then_close_1008(server: ServerProcess, key: str | None) -> None:
    c = await LiveClient.connect(server.url, api_key=key)
    try:
        ev = await c.next_event(wire.Error)
        assert ev.error.code == "invalid_api_key"
        assert ev.error.type == "invalid_request_error"
        assert await c.wait_closed() == 1008
    finally:
        await c.close()


# --- session.start ----------------------------------------------------------------------------------------------


async def test_session_started_resource(server: ServerProcess) -> None:
    c = await LiveClient.connect(server.url)
    try:
        before = time.time()
        ev = await c.start(
            {
                "model": "gpt-live-1",
                "instructions": "Be brief.",
                "input": [
                    {
                        "type": "message",
                        "role": "developer",
                        "content": [{"type": "input_text", "text": "hi"}],
                    },
                    {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
                ],
                "audio": {"output": {"voice": "cedar"}},
                "delegation": {"type": "client"},
                "unknown_field": {"ignored": True},
            }
        )
        assert isinstance(ev, wire.SessionStarted) and ev.client_event_id == "start"
        s = ev.session
        assert s.id.startswith("live_") and s.status == "active" and s.model == "gpt-live-1"
        assert s.instructions == "Be brief."
        assert msgspec.to_builtins(s.audio) == {
            "format": {"type": "audio/pcm", "rate": 24000},
            "output": {"voice": "cedar"},
        }
        assert s.delegation.type == "client"
        assert [i.role for i in s.input or []] == ["developer", "assistant"]
        lifetime = 3600  # the default session lifetime
        assert before + lifetime - 5 <= s.expires_at <= time.time() + lifetime + 5
    finally:
        await c.close()


async def test_store_is_not_available_and_says_so(server: ServerProcess) -> None:
    c = await LiveClient.connect(server.url)
    try:
        ev = await c.start({"model": "m", "store": True, "safety_identifier": "user-1"})
        assert isinstance(ev, wire.SessionStarted)
        assert ev.session.store is False and ev.session.safety_identifier == "user-1"
        info = await c.next_event(wire.Info)
        assert info.code == "store_unavailable" and info.message
    finally:
        await c.close()


def test_webrtc_offer_without_key_gets_401(server: ServerProcess) -> None:
    body = json.dumps({"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": "v=0"}}).encode()
    req = urllib.request.Request(server.url + "/v1/live/sessions", data=body, method="POST")
    req.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
    err = json.loads(e.value.read())["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"


async def test_bare_path_and_query_params_are_accepted(server: ServerProcess) -> None:
    c = await started(server, path="/live/sessions?model=openai/gpt-live-1")
    await c.close()


async def test_responses_delegation_is_accepted(server: ServerProcess) -> None:
    """GPTLiveModel's default delegation: the session starts with it echoed, and no delegation event follows."""
    c = await LiveClient.connect(server.url)
    try:
        responses = {"model": "gpt-5.6-luna", "tools": []}
        ev = await c.start({"model": "m", "delegation": {"type": "responses", "responses": responses}})
        assert isinstance(ev, wire.SessionStarted), ev
        assert ev.session.delegation.type == "responses" and ev.session.delegation.responses == responses
        await still_alive(c)
    finally:
        await c.close()


async def test_unsupported_delegation_is_refused_and_closed(server: ServerProcess) -> None:
    c = await LiveClient.connect(server.url)
    try:
        ev = await c.start({"model": "m", "delegation": {"type": "decisions", "decisions": {}}})
        assert isinstance(ev, wire.Error) and ev.error.code == "unsupported_delegation", ev
        assert "client" in ev.error.message and ev.error.client_event_id == "start"
        assert await c.wait_closed() == 1008
    finally:
        await c.close()


async def test_bad_audio_format_is_refused(server: ServerProcess) -> None:
    c = await LiveClient.connect(server.url)
    try:
        ev = await c.start({"model": "m", "audio": {"format": {"type": "audio/pcm", "rate": 44100}}})
        assert isinstance(ev, wire.Error) and ev.error.param == "session.audio.format.rate"
        assert await c.wait_closed() == 1008
    finally:
        await c.close()


async def test_event_before_session_start(server: ServerProcess) -> None:
    c = await LiveClient.connect(server.url)
    try:
        await c.send({"type": "session.input_audio.mute", "event_id": "early"})
        ev = await expect_error(c, "session_not_started")
        assert ev.error.client_event_id == "early" and ev.client_event_id == "early"
        assert isinstance(await c.start(), wire.SessionStarted)  # the connection is still usable
    finally:
        await c.close()


async def test_second_session_start(server: ServerProcess) -> None:
    c = await started(server)
    try:
        await c.send({"type": "session.start", "event_id": "again", "session": {"model": "m"}})
        ev = await expect_error(c, "session_already_started")
        assert ev.error.client_event_id == "again"
        await still_alive(c)
    finally:
        await c.close()


# --- malformed commands -----------------------------------------------------------------------------------------


async def test_bad_base64_audio(server: ServerProcess) -> None:
    c = await started(server)
    try:
        await c.send({"type": "session.input_audio.append", "event_id": "a1", "audio": "not base64!!"})
        ev = await expect_error(c, "invalid_audio")
        assert ev.error.param == "audio" and ev.error.client_event_id == "a1"
        await still_alive(c)
    finally:
        await c.close()


async def test_odd_byte_count_pcm16(server: ServerProcess) -> None:
    c = await started(server)
    try:
        await c.send({"type": "session.input_audio.append", "audio": b64(b"\x00\x01\x02")})
        ev = await expect_error(c, "invalid_audio")
        assert "16-bit" in ev.error.message
        await still_alive(c)
    finally:
        await c.close()


async def test_unknown_event(server: ServerProcess) -> None:
    c = await started(server)
    try:
        await c.send({"type": "session.frobnicate", "event_id": "u1"})
        ev = await expect_error(c, "unknown_event")
        assert ev.error.client_event_id == "u1" and "session.frobnicate" in ev.error.message
        # Known, but only under responses delegation (this session has none: client).
        await c.send({"type": "response.create", "event_id": "r1"})
        ev = await expect_error(c, "responses_delegation_required")
        assert ev.error.client_event_id == "r1" and "responses delegation" in ev.error.message
        await c.send(
            {
                "type": "response.item.create",
                "item": {"type": "function_call_output", "call_id": "call_1", "output": "42"},
            }
        )
        await expect_error(c, "responses_delegation_required")
        await c.send({"type": "decision.create", "event_id": "d1"})
        assert "Decisions" in (await expect_error(c, "unsupported_event")).error.message
        await still_alive(c)
    finally:
        await c.close()


async def test_invalid_json_and_non_object(server: ServerProcess) -> None:
    c = await started(server)
    try:
        await c.send_raw("{not json")
        await expect_error(c, "invalid_json")
        await c.send_raw("[1, 2]")
        await expect_error(c, "invalid_json")
        # 5,000 nested arrays used to end the session with close 1000 and no error event.
        await c.send_raw('{"type":"session.update","session":' + "[" * 5000 + "]" * 5000 + "}")
        await expect_error(c, "invalid_json")
        await c.send({"event_id": "no-type"})
        await expect_error(c, "invalid_event")
        await still_alive(c)
    finally:
        await c.close()


async def test_oversized_message(server: ServerProcess) -> None:
    c = await started(server)
    try:
        big = "A" * (MAX_MESSAGE + 1024)
        await c.send({"type": "session.input_audio.append", "audio": big})
        ev = await expect_error(c, "message_too_large")
        assert str(MAX_MESSAGE) in ev.error.message
        await still_alive(c)
    finally:
        await c.close()


async def test_immutable_update_is_refused_and_allowed_update_applies(server: ServerProcess) -> None:
    c = await started(server)
    try:
        for field, value in (
            ("instructions", "new"),
            ("audio", {"output": {"voice": "ash"}}),
            ("model", "x"),
        ):
            await c.send({"type": "session.update", "event_id": f"u-{field}", "session": {field: value}})
            ev = await expect_error(c, "immutable_field")
            assert ev.error.param == f"session.{field}" and ev.error.client_event_id == f"u-{field}"
        await c.send(
            {
                "type": "session.update",
                "event_id": "u-type",
                "session": {"delegation": {"type": "responses", "responses": {}}},
            }
        )
        await expect_error(c, "immutable_field")
        await c.send(
            {
                "type": "session.update",
                "event_id": "ok",
                "session": {
                    "delegation": {"type": "client", "acknowledgement_delay_ms": 250},
                    "triggers": [],
                },
            }
        )
        ev = await c.next_event(wire.SessionUpdated)
        assert ev.client_event_id == "ok"
        assert ev.session.delegation == wire.Delegation(type="client", acknowledgement_delay_ms=250)
        await still_alive(c)
    finally:
        await c.close()


# --- mute, appends, fixtures ------------------------------------------------------------------------------------


async def test_mute_and_unmute_are_acknowledged_and_idempotent(server: ServerProcess) -> None:
    c = await started(server)
    try:
        for i, kind in enumerate(["mute", "mute", "unmute", "unmute"]):
            await c.send({"type": f"session.input_audio.{kind}", "event_id": f"m{i}"})
            ev = await c.next_event((wire.InputAudioMuted, wire.InputAudioUnmuted, wire.Error))
            assert wire.event_type(ev) == f"session.input_audio.{kind}d" and ev.client_event_id == f"m{i}"
    finally:
        await c.close()


async def test_muted_input_is_not_heard(server: ServerProcess) -> None:
    """Muted, the tone is not heard (the loopback echoes silence); unmuted, the same tone in the same session is
    echoed back: the positive control that shows this session would have echoed it."""
    c = await started(server)
    try:
        await c.send({"type": "session.input_audio.mute"})
        await c.next_event(wire.InputAudioMuted)
        await c.append_audio(tone(0.6, 24000).astype("<i2").tobytes(), bytes_per_100ms=4800)
        await c.append_audio(bytes(4800 * 5), bytes_per_100ms=4800)  # time for an echo to come back
        muted_out = decode(bytes(c.audio), "pcm24k")
        assert len(muted_out) >= 24000 // 2, "the loopback echoes silence while input arrives"
        assert len(loud_frames(muted_out, 24000)) == 0  # the engine heard none of the tone
        await c.send({"type": "session.input_audio.unmute"})
        await c.next_event(wire.InputAudioUnmuted)
        await c.append_audio(tone(0.6, 24000).astype("<i2").tobytes(), bytes_per_100ms=4800)
        await c.append_audio(bytes(4800 * 5), bytes_per_100ms=4800)
        unmuted_out = decode(bytes(c.audio), "pcm24k")[len(muted_out) :]
        loud = loud_frames(unmuted_out, 24000)
        assert len(loud) >= 20, len(loud)  # most of the 30 frames of tone came back
        assert abs(dominant_hz(unmuted_out, 24000) - 440) < 10
    finally:
        await c.close()


@pytest.mark.parametrize("kind", ["instructions", "thinking", "commentary"])
async def test_text_appends_are_acknowledged_on_the_timeline(server: ServerProcess, kind: str) -> None:
    c = await started(server)
    try:
        await c.append_audio(bytes(4800 * 3), bytes_per_100ms=4800)  # move the input timeline
        await asyncio.sleep(0.1)
        await c.send(
            {"type": f"session.{kind}.append", "event_id": "t1", "content": "hello", "delegation_id": None}
        )
        ev = await c.next_event(ACKS[kind])
        assert ev.client_event_id == "t1"
        assert isinstance(ev.start_ms, int) and isinstance(ev.end_ms, int)
        assert 0 < ev.start_ms <= ev.end_ms
        # delegation_id is a required key; an unknown delegation id is refused; content must be a string.
        await c.send({"type": f"session.{kind}.append", "content": "x"})
        assert (await expect_error(c, "missing_required_parameter")).error.param == "delegation_id"
        await c.send({"type": f"session.{kind}.append", "content": "x", "delegation_id": "del_nope"})
        await expect_error(c, "unknown_delegation")
        await c.send({"type": f"session.{kind}.append", "content": 5, "delegation_id": None})
        assert (await expect_error(c, "invalid_value")).error.param == "content"
    finally:
        await c.close()


async def test_fixture_plays_and_input_is_dropped_meanwhile(server: ServerProcess) -> None:
    c = await started(server)
    try:
        clip = tone(1.0, 24000, freq=660.0)
        await c.send(
            {"type": "session.output_audio.fixture.play", "event_id": "f1", "audio": b64(clip.tobytes())}
        )
        ev = await c.next_event((wire.FixturePlaying, wire.Error))
        assert isinstance(ev, wire.FixturePlaying) and ev.client_event_id == "f1"
        # Talk over the fixture: that input is dropped (not echoed), and appends are refused meanwhile.
        await c.send({"type": "session.commentary.append", "content": "x", "delegation_id": None})
        await expect_error(c, "fixture_active")
        talk = asyncio.create_task(c.append_audio(tone(0.6, 24000).tobytes(), bytes_per_100ms=4800))
        ev = await c.next_event(wire.FixturePlayed, timeout=5)
        assert ev.client_event_id == "f1"
        await talk
        await asyncio.sleep(0.6)  # anything echoed would be out by now
        out = decode(bytes(c.audio), "pcm24k")
        loud = loud_frames(out, 24000)
        assert 45 <= len(loud) <= 52, len(loud)  # the 1 s clip, nothing else
        seg = out[loud[0] * 480 : (loud[-1] + 1) * 480]
        assert abs(dominant_hz(seg, 24000) - 660) < 10
        # The session goes on normally afterwards.
        await c.send({"type": "session.commentary.append", "content": "x", "delegation_id": None})
        await c.next_event(wire.CommentaryAppended)
    finally:
        await c.close()


async def test_fixture_limits(server: ServerProcess) -> None:
    c = await started(server)
    try:
        too_long = tone(2.5, 24000)  # this server allows 2 s
        await c.send({"type": "session.output_audio.fixture.play", "audio": b64(too_long.tobytes())})
        await expect_error(c, "fixture_too_long")
        await c.send({"type": "session.output_audio.fixture.play", "audio": b64(b"\x01\x02\x03")})
        await expect_error(c, "invalid_audio")
        await still_alive(c)
    finally:
        await c.close()


# --- close, usage, backpressure ---------------------------------------------------------------------------------


async def test_session_close(server: ServerProcess) -> None:
    c = await started(server)
    try:
        await asyncio.sleep(0.3)
        await c.send({"type": "session.close", "event_id": "bye"})
        ev = await c.next_event(wire.SessionClosed)
        assert ev.reason == "close_requested" and ev.client_event_id == "bye"
        assert isinstance(ev.usage.seconds, float) and ev.usage.seconds >= 0.2
        assert ev.session.status == "active" and ev.session.id.startswith("live_")
        assert await c.wait_closed() == 1000
        assert isinstance(c.events[-1], wire.SessionClosed)  # terminal
    finally:
        await c.close()


async def test_usage_is_cumulative(server: ServerProcess) -> None:
    c = await started(server)
    try:
        first = await c.next_event(wire.UsageUpdated, timeout=8)
        assert 4.5 <= first.usage.seconds <= 6.5
        await c.send({"type": "session.close"})
        closed = await c.next_event(wire.SessionClosed)
        assert closed.usage.seconds >= first.usage.seconds
    finally:
        await c.close()


async def test_sustained_faster_than_real_time_input(server: ServerProcess) -> None:
    c = await started(server)
    try:
        chunk = b64(bytes(4800))  # 100 ms of silence at 24 kHz
        t0 = time.monotonic()
        # Twice real time: 1 s ahead (this server's burst allowance) after ~1 s, closed ~1 s (the grace) later.
        while not c.closed.is_set() and time.monotonic() - t0 < 10:
            try:
                await c.send({"type": "session.input_audio.append", "audio": chunk})
            except Exception:
                break
            await asyncio.sleep(0.05)
        assert await c.wait_closed() == 1013
        errors = c.of(wire.Error)
        assert [e.error.code for e in errors] == ["input_backpressure"]  # once
        assert isinstance(c.events[-1], wire.SessionClosed)
        assert 1.5 < time.monotonic() - t0 < 6
    finally:
        await c.close()


async def test_a_burst_within_the_allowance_is_accepted(server: ServerProcess) -> None:
    c = await started(server)
    try:
        # 0.8 s at once (LiveKit's start-up backlog), then real time: no error.
        await c.append_audio(bytes(4800 * 8), bytes_per_100ms=4800, realtime=False)
        await c.append_audio(bytes(4800 * 5), bytes_per_100ms=4800)
        await still_alive(c)
        assert not c.of(wire.Error)
    finally:
        await c.close()


# --- audio round trip in every format ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
async def test_loopback_echo_in_each_format(server: ServerProcess, name: str) -> None:
    fmt, rate, bps = FORMATS[name]
    c = await started(server, {"model": "m", "audio": {"format": fmt}})
    try:
        t0 = time.monotonic()
        sent = np.concatenate([tone(1.0, rate), np.zeros(rate, dtype=np.int16)])
        await c.append_audio(encode(sent, name), bytes_per_100ms=rate // 10 * bps)
        elapsed = time.monotonic() - t0
        await c.send({"type": "session.close"})
        await c.next_event(wire.SessionClosed)
        # Continuous output in the session format: whole samples, 20-100 ms chunks, at about real time.
        sizes = [n for _, n in c.deltas]
        assert all(n % bps == 0 for n in sizes)
        assert all(20 <= n / bps / rate * 1000 <= 100 for n in sizes), sorted(set(sizes))
        out = decode(bytes(c.audio), name)
        assert elapsed * 0.85 <= len(out) / rate <= elapsed * 1.2 + 0.3
        # The 1 s tone comes back once, at 440 Hz, about the loopback delay later. The loopback releases echo only
        # when input arrives, in 100 ms appends here, so a late append on a busy machine can leave short gaps of
        # silence inside the echo (each gap also splits a 20 ms frame, so frame counts vary): "once" is checked on
        # the energy, which gaps do not change and a lost or repeated stretch would.
        echo_energy = float(np.sum(out.astype(np.float64) ** 2))
        tone_energy = float(np.sum(tone(1.0, rate).astype(np.float64) ** 2))
        assert 0.95 <= echo_energy / tone_energy <= 1.05, echo_energy / tone_energy  # one 100 ms append = 10%
        loud = loud_frames(out, rate)
        assert len(loud) >= 45, len(loud)
        assert loud[-1] - loud[0] < 70
        seg = out[loud[0] * rate // 50 : (loud[-1] + 1) * rate // 50]
        assert abs(dominant_hz(seg, rate) - 440) < 10
        assert 0.1 <= loud[0] * 0.02 <= 0.8
    finally:
        await c.close()


# --- the stock openai SDK ---------------------------------------------------------------------------------------


async def test_openai_sdk_session(server: ServerProcess) -> None:
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    audio = bytearray()
    types: list[str] = []
    async with client.live.connect() as conn:
        await conn.session.start(
            session={"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
            event_id="sdk-start",
        )
        ev = await asyncio.wait_for(conn.recv(), 10)
        assert ev.type == "session.started" and ev.session.id.startswith("live_")
        assert ev.client_event_id == "sdk-start"
        # Streamed like a microphone: the tone, then silence (the loopback echoes as input keeps arriving).
        clip = np.concatenate([tone(0.5, 24000), np.zeros(12000, np.int16)])
        for i in range(0, len(clip), 2400):
            await conn.session.input_audio.append(audio=b64(clip[i : i + 2400].tobytes()))
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            ev = await asyncio.wait_for(conn.recv(), 5)
            types.append(ev.type)
            if ev.type == "session.output_audio.delta":
                audio += base64.b64decode(ev.delta)
                if len(loud_frames(decode(bytes(audio), "pcm24k"), 24000)) >= 20:
                    break
        await conn.session.close(event_id="sdk-close")
        closed = None
        async for ev in conn:  # ends cleanly when the server closes with 1000
            if ev.type == "session.closed":
                closed = ev
    assert closed is not None and closed.reason == "close_requested" and closed.client_event_id == "sdk-close"
    assert len(loud_frames(decode(bytes(audio), "pcm24k"), 24000)) >= 20
    assert "error" not in types


# --- metrics ----------------------------------------------------------------------------------------------------


def scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as ``{(sample name, sorted labels): value}``, parsed by prometheus_client's own parser."""
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_sessions_errors_and_audio(server: ServerProcess) -> None:
    """Runs its own traffic and checks each counter moved by exactly what that traffic was (it does not rely on
    the rest of the module having run first)."""

    def value(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    before = await asyncio.to_thread(scrape, server)
    bad = await LiveClient.connect(server.url, api_key="sk-wrong")
    assert (await bad.next_event(wire.Error)).error.code == "invalid_api_key"
    await bad.close()
    refused = await LiveClient.connect(server.url)
    ev = await refused.start({"model": "m", "delegation": {"type": "decisions", "decisions": {}}})
    assert isinstance(ev, wire.Error)
    await refused.close()
    c = await started(server)
    try:
        await c.send({"type": "session.frobnicate"})
        await expect_error(c, "unknown_event")
        during = await asyncio.to_thread(scrape, server)
        assert value(during, "livekit_omni_active_sessions", transport="websocket") == 1.0
        await c.append_audio(tone(1.0, 24000).astype("<i2").tobytes(), bytes_per_100ms=4800)
        await asyncio.sleep(0.3)
    finally:
        await c.close()
    out_s = len(c.audio) / 2 / 24000
    assert out_s > 0.5
    deadline = time.monotonic() + 5
    while True:
        after = await asyncio.to_thread(scrape, server)
        if value(after, "livekit_omni_active_sessions", transport="websocket") == 0.0:
            break
        assert time.monotonic() < deadline, "the closed session is still counted as active"
        await asyncio.sleep(0.1)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("livekit_omni_sessions_total", transport="websocket") == 1.0
    assert delta("livekit_omni_errors_total", code="unknown_event") == 1.0
    assert delta("livekit_omni_errors_total", code="invalid_api_key") == 1.0
    assert delta("livekit_omni_rejected_sessions_total", reason="unsupported_delegation") == 1.0
    assert delta("livekit_omni_audio_in_seconds_total") == pytest.approx(1.0, abs=0.02)
    # Everything the server counted as sent reached this client (the last frames may still be in flight).
    assert out_s - 0.1 <= delta("livekit_omni_audio_out_seconds_total") <= out_s + 0.1
