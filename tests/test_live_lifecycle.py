"""Server-side ends of a Live session: the session limit, lifetime expiry, and the engine dying mid-session.

One loopback server for the module, with room for one session and a 2 s session lifetime.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import numpy as np
import pytest

from livekit_omni.live import wire
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import ServerProcess, start_server

LIFETIME_S = 2.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "1",
            "LIVEKIT_OMNI_LIMITS__SESSION_LIFETIME_S": str(LIFETIME_S),
        },
    )
    yield s
    s.stop()


def tone(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()


async def wait_engine_idle(server: ServerProcess, timeout: float = 10.0) -> None:
    """Until /health says ready with no session open (the previous test's session is released)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, body = await asyncio.to_thread(server.health)
        if code == 200 and body["engine"].get("active_sessions") == 0:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"engine not idle: {body}")


async def test_session_limit_refuses_with_1013(server: ServerProcess) -> None:
    await wait_engine_idle(server)
    first = await LiveClient.connect(server.url)
    second = await LiveClient.connect(server.url)
    try:
        assert isinstance(await first.start(), wire.SessionStarted)
        ev = await second.start()
        assert isinstance(ev, wire.Error) and ev.error.code == "session_limit_reached", ev
        assert ev.error.client_event_id == "start"
        assert await second.wait_closed() == 1013
        # A WebRTC offer is refused the same way, as HTTP 503.
        caller = WebRTCCaller()
        try:
            body = {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await caller.offer()}}
            async with (
                aiohttp.ClientSession() as http,
                http.post(server.url + "/v1/live/sessions", json=body) as r,
            ):
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "session_limit_reached"
        finally:
            await caller.close()
        await first.send({"type": "session.close"})
        await first.next_event(wire.SessionClosed)
    finally:
        await first.close()
        await second.close()


async def test_lifetime_expiry_closes_with_reason_expired(server: ServerProcess) -> None:
    await wait_engine_idle(server)
    c = await LiveClient.connect(server.url)
    try:
        t0 = time.time()
        started = await c.start()
        assert isinstance(started, wire.SessionStarted)
        assert abs(started.session.expires_at - (t0 + LIFETIME_S)) <= 1.5
        ev = await c.next_event(wire.SessionClosed, timeout=LIFETIME_S + 3)
        assert ev.reason == "expired"
        assert LIFETIME_S - 0.2 <= time.time() - t0 <= LIFETIME_S + 1.5
        assert ev.usage.seconds >= LIFETIME_S - 0.2
        assert await c.wait_closed() == 1000
    finally:
        await c.close()


async def test_engine_killed_mid_session_then_a_new_session_works(server: ServerProcess) -> None:
    await wait_engine_idle(server)
    pid = server.engine_pid()
    c = await LiveClient.connect(server.url)
    try:
        assert isinstance(await c.start(), wire.SessionStarted)
        await c.append_audio(bytes(4800 * 2), bytes_per_100ms=4800)
        os.kill(pid, signal.SIGKILL)
        err = await c.next_event(wire.Error, timeout=5)
        assert err.error.code == "engine_lost" and err.error.type == "server_error"
        # Meanwhile the supervisor is bringing up a new engine: a session asked for now is refused, retryably.
        during = await LiveClient.connect(server.url)
        try:
            ev = await during.start()
            assert isinstance(ev, wire.Error) and ev.error.code == "engine_unavailable", ev
            assert await during.wait_closed() == 1013
        finally:
            await during.close()
        closed = await c.next_event(wire.SessionClosed, timeout=5)
        assert closed.reason == "connection_lost"
        assert await c.wait_closed() == 1011
    finally:
        await c.close()

    # The supervisor starts a new engine; a new session then works end to end.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        code, body = await asyncio.to_thread(server.health)
        if code == 200 and body["engine"]["pid"] != pid:
            break
        await asyncio.sleep(0.2)
    else:
        raise AssertionError(f"no new engine: {body}")
    c = await LiveClient.connect(server.url)
    try:
        assert isinstance(await c.start(), wire.SessionStarted)
        await c.append_audio(tone(0.4) + bytes(4800 * 4), bytes_per_100ms=4800)
        out = np.frombuffer(bytes(c.audio), dtype="<i2")
        assert np.abs(out).max() > 4000  # the echo came back
        await c.send({"type": "session.close"})
        assert (await c.next_event(wire.SessionClosed)).reason == "close_requested"
    finally:
        await c.close()
