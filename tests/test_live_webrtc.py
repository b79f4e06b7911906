"""The Live facade over WebRTC: ``POST /v1/live/sessions`` with an SDP offer, audio on the track, events on the
data channel. An aiortc client (testkit.webrtc_caller.WebRTCCaller) against a real loopback server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from media.webrtc import enable_loopback_ice
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import ServerProcess, start_server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    enable_loopback_ice()  # the client side of this process gathers 127.0.0.1 only
    s = start_server(adapter="loopback", env={"LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true"})
    yield s
    s.stop()


def tone48k(seconds: float, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * 48000)) / 48000
    return (8000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


async def post(
    server: ServerProcess, body: Any, path: str = "/v1/live/sessions"
) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        data = body if isinstance(body, str) else json.dumps(body)
        async with http.post(server.url + path, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


async def next_message(
    caller: WebRTCCaller, seen: list[dict[str, Any]], type_: str, timeout: float = 10.0
) -> dict:
    """The next data-channel event of ``type_`` (every event received is appended to ``seen``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while caller.messages:
            ev = json.loads(caller.messages.popleft())
            seen.append(ev)
            if ev["type"] == type_:
                return ev
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no {type_} on the data channel; got {[e['type'] for e in seen]}")


def loud_frames(pcm: np.ndarray, rate: int) -> np.ndarray:
    n = rate // 50
    frames = pcm[: len(pcm) // n * n].astype(np.float64).reshape(-1, n)
    return np.nonzero(np.sqrt((frames**2).mean(axis=1)) > 1000)[0]


@pytest.mark.parametrize("codecs", [None, ["audio/PCMU"]], ids=["opus", "pcmu"])
async def test_webrtc_offer_answer_events_and_echo(server: ServerProcess, codecs: list[str] | None) -> None:
    caller = WebRTCCaller(
        np.concatenate([np.zeros(24000, np.int16), tone48k(1.0)]), loop=False, codecs=codecs
    )
    seen: list[dict[str, Any]] = []
    try:
        status, body = await post(
            server,
            {
                "session": {"model": "gpt-live-1", "instructions": "hi"},
                "transport": {"type": "webrtc", "sdp": await caller.offer()},
            },
        )
        assert status == 200, body
        assert body["transport"]["type"] == "webrtc" and "m=audio" in body["transport"]["sdp"]
        sid = body["session"]["id"]
        await caller.accept(body["transport"]["sdp"])
        await asyncio.wait_for(caller.opened.wait(), 10)
        started = await next_message(caller, seen, "session.started")
        assert seen[0] is started  # the first event on the channel
        assert started["session"]["id"] == sid and "format" not in started["session"]["audio"]

        # Events: same semantics as the WebSocket; no session.start and no audio appends on the data channel.
        caller.send(
            json.dumps(
                {
                    "type": "session.commentary.append",
                    "event_id": "c1",
                    "content": "hi",
                    "delegation_id": None,
                }
            )
        )
        ev = await next_message(caller, seen, "session.commentary.appended")
        assert ev["client_event_id"] == "c1" and isinstance(ev["start_ms"], int)
        caller.send(json.dumps({"type": "session.start", "event_id": "s2", "session": {"model": "m"}}))
        assert (await next_message(caller, seen, "error"))["error"]["code"] == "session_already_started"
        caller.send(json.dumps({"type": "session.input_audio.append", "audio": ""}))
        assert (await next_message(caller, seen, "error"))["error"]["code"] == "unsupported_event"

        # Speak: the tone comes back on the track (loopback echo).
        deadline = time.monotonic() + 10
        rate = 0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            rate = caller.rate
            if rate and len(loud_frames(caller.received_audio(), rate)) >= 45:
                break
        out = caller.received_audio()
        loud = loud_frames(out, rate)
        assert 45 <= len(loud) <= 56, len(loud)
        assert rate == (8000 if codecs else 48000)
        seg = out[loud[0] * rate // 50 : (loud[-1] + 1) * rate // 50].astype(np.float64)
        spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
        assert abs(np.fft.rfftfreq(len(seg), 1 / rate)[int(np.argmax(spec))] - 440) < 10

        caller.send(json.dumps({"type": "session.close", "event_id": "bye"}))
        closed = await next_message(caller, seen, "session.closed")
        assert closed["reason"] == "close_requested" and closed["client_event_id"] == "bye"
    finally:
        await caller.close()


async def test_webrtc_bare_path_and_permissions(server: ServerProcess) -> None:
    caller = WebRTCCaller(loop=True)
    seen: list[dict[str, Any]] = []
    try:
        session = {
            "model": "m",
            "client": {
                "data_channel": {
                    "allowed_client_events": ["session.close", "session.thinking.append"],
                    "allowed_server_events": [
                        {"type": "session.started"},
                        {"type": "session.closed"},
                        {"type": "error"},
                    ],
                }
            },
        }
        status, body = await post(
            server,
            {"session": session, "transport": {"type": "webrtc", "sdp": await caller.offer()}},
            "/live/sessions",
        )
        assert status == 200, body
        await caller.accept(body["transport"]["sdp"])
        await asyncio.wait_for(caller.opened.wait(), 10)
        started = await next_message(caller, seen, "session.started")
        assert started["session"]["client"]["data_channel"]["allowed_client_events"] == [
            "session.close",
            "session.thinking.append",
        ]
        caller.send(json.dumps({"type": "session.input_audio.mute", "event_id": "m"}))
        ev = await next_message(caller, seen, "error")
        assert ev["error"]["code"] == "event_not_allowed"
        caller.send(json.dumps({"type": "session.thinking.append", "content": "x", "delegation_id": None}))
        caller.send(json.dumps({"type": "session.close"}))
        await next_message(caller, seen, "session.closed")
        assert "session.thinking.appended" not in [e["type"] for e in seen]  # filtered out
    finally:
        await caller.close()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("{nope", "invalid_json"),
        ({"session": {"model": "m"}, "transport": {"type": "websocket", "sdp": "v=0"}}, "invalid_value"),
        ({"session": {}, "transport": {"type": "webrtc", "sdp": "v=0"}}, "invalid_value"),
        (
            {
                "session": {"model": "m"},
                "transport": {"type": "webrtc", "sdp": "v=0\r\n" + "a=x\r\n" * 20000},
            },
            "sdp_too_large",
        ),
        (
            {
                "session": {"model": "m", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
                "transport": {"type": "webrtc", "sdp": "v=0"},
            },
            "unsupported_parameter",
        ),
        (
            {
                "session": {"model": "m", "delegation": {"type": "decisions"}},
                "transport": {"type": "webrtc", "sdp": "v=0"},
            },
            "unsupported_delegation",
        ),
        (
            {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": "v=0\r\ns=-\r\n"}},
            "invalid_sdp",
        ),
    ],
    ids=["json", "transport", "model", "sdp-size", "format", "delegation", "no-audio"],
)
async def test_webrtc_bad_requests_get_400(server: ServerProcess, body: Any, code: str) -> None:
    status, out = await post(server, body)
    assert status == 400, out
    assert out["error"]["code"] == code and out["error"]["type"] and out["error"]["message"]
    # A refused offer leaves no session behind.
    assert (await asyncio.to_thread(server.health))[1]["engine"]["active_sessions"] == 0


async def test_webrtc_fixture_plays_on_the_track(server: ServerProcess) -> None:
    caller = WebRTCCaller(loop=True)  # silence
    seen: list[dict[str, Any]] = []
    try:
        status, body = await post(
            server, {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await caller.offer()}}
        )
        assert status == 200, body
        await caller.accept(body["transport"]["sdp"])
        await asyncio.wait_for(caller.opened.wait(), 10)
        await next_message(caller, seen, "session.started")
        t = np.arange(24000) / 24000
        clip = (8000 * np.sin(2 * np.pi * 660 * t)).astype("<i2").tobytes()
        caller.send(
            json.dumps(
                {
                    "type": "session.output_audio.fixture.play",
                    "event_id": "f",
                    "audio": base64.b64encode(clip).decode(),
                }
            )
        )
        assert (await next_message(caller, seen, "session.output_audio.fixture.playing"))[
            "client_event_id"
        ] == "f"
        assert (await next_message(caller, seen, "session.output_audio.fixture.played"))[
            "client_event_id"
        ] == "f"
        await asyncio.sleep(0.5)  # the tail of the clip crosses the network
        out = caller.received_audio()
        loud = loud_frames(out, caller.rate)
        assert 45 <= len(loud) <= 56, len(loud)
        seg = out[loud[0] * caller.rate // 50 : (loud[-1] + 1) * caller.rate // 50].astype(np.float64)
        spec = np.abs(np.fft.rfft(seg * np.hanning(len(seg))))
        assert abs(np.fft.rfftfreq(len(seg), 1 / caller.rate)[int(np.argmax(spec))] - 660) < 10
    finally:
        await caller.close()
