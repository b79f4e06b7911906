"""Graceful drain: SIGTERM to a real ``livekit-omni serve`` (loopback engine) with a session open.

Admission stops (/health 503 ``draining``; a new WebSocket session gets ``server_draining`` and 1013; a WebRTC
offer gets HTTP 503), the open session keeps working through the grace, then it is closed with ``server_shutdown``
and 1012, and the process exits 0. Plus the drain object alone: it ends as soon as the last session is gone.
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import numpy as np
import pytest

from livekit_omni.drain import Drain, DrainStatus
from livekit_omni.live import wire
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import start_server

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): SIGTERM drains of real server processes.
pytestmark = pytest.mark.slow

#: Long enough for the checks made during the drain (a WebRTC offer, 0.4 s of audio at real time, a mute) on a
#: loaded 2-core machine running the whole suite.
GRACE_S = 15.0


def tone(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()


async def test_sigterm_drains_open_session_then_closes_it_with_1012_and_exits_0() -> None:
    server = start_server(adapter="loopback", env={"LIVEKIT_OMNI_DRAIN_GRACE_S": str(GRACE_S)})
    open_client = await LiveClient.connect(server.url)
    try:
        assert isinstance(await open_client.start(), wire.SessionStarted)
        server.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()

        # /health says draining (503: out of the load balancer's rotation).
        deadline = time.monotonic() + 3
        while True:
            code, body = await asyncio.to_thread(server.health)
            if body.get("status") == "draining":
                break
            assert time.monotonic() < deadline, f"/health never said draining: {code} {body}"
            await asyncio.sleep(0.05)
        assert code == 503 and 0 < body["drain_remaining_s"] <= GRACE_S

        # A new WebSocket session is refused: error first, then 1013.
        late = await LiveClient.connect(server.url)
        try:
            ev = await late.start()
            assert isinstance(ev, wire.Error) and ev.error.code == "server_draining", ev
            assert await late.wait_closed() == 1013
        finally:
            await late.close()
        # A WebRTC offer likewise, as HTTP 503.
        caller = WebRTCCaller()
        try:
            offer = {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await caller.offer()}}
            async with (
                aiohttp.ClientSession() as http,
                http.post(server.url + "/v1/live/sessions", json=offer) as r,
            ):
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "server_draining"
        finally:
            await caller.close()

        # The open session still works: the loopback engine echoes its audio, and commands are answered.
        await open_client.append_audio(tone(0.4) + bytes(4800 * 4), bytes_per_100ms=4800)
        out = np.frombuffer(bytes(open_client.audio), dtype="<i2")
        assert np.abs(out).max() > 4000, "no echo during the drain"
        await open_client.send({"type": "session.input_audio.mute", "event_id": "m1"})
        muted = await open_client.next_event(wire.InputAudioMuted, timeout=5)
        assert muted.client_event_id == "m1"
        assert time.monotonic() - t_term < GRACE_S, "the checks above took longer than the grace"

        # After the grace: an error event first, then session.closed, then close 1012.
        err = await open_client.next_event(wire.Error, timeout=GRACE_S + 5)
        waited = time.monotonic() - t_term
        assert err.error.code == "server_shutdown", err
        assert GRACE_S - 0.5 <= waited <= GRACE_S + 3, waited
        closed = await open_client.next_event(wire.SessionClosed, timeout=5)
        assert closed.reason == "connection_lost"
        assert await open_client.wait_closed() == 1012
        kinds = [wire.event_type(e) for e in open_client.events]
        assert kinds.index("error") < kinds.index("session.closed")

        rc = await asyncio.to_thread(server.proc.wait, 20)
        assert rc == 0, server.log_tail()
    finally:
        await open_client.close()
        server.stop()


async def test_drain_ends_as_soon_as_the_last_session_is_gone() -> None:
    sessions = {"a"}
    closed_by_drain: list[bool] = []

    async def close_all() -> None:
        closed_by_drain.append(True)

    drain = Drain(grace_s=30.0)
    assert drain.admitting
    task = asyncio.create_task(drain.run(sessions, close_all))
    await asyncio.sleep(0.3)
    assert drain.status is DrainStatus.DRAINING and not drain.admitting and not task.done()
    sessions.clear()  # the last session ended by itself
    t0 = time.monotonic()
    assert await asyncio.wait_for(task, 2.0) == 0
    assert time.monotonic() - t0 < 0.5
    assert drain.status is DrainStatus.DRAINED and closed_by_drain == []


async def test_second_signal_cuts_the_grace_short() -> None:
    sessions = {"a", "b"}

    async def close_all() -> None:
        sessions.clear()

    drain = Drain(grace_s=30.0)
    task = asyncio.create_task(drain.run(sessions, close_all))
    await asyncio.sleep(0.2)
    drain.cut_short()
    assert await asyncio.wait_for(task, 2.0) == 2
    assert sessions == set()
