"""Faults on a real server: the engine killed (kill -9) during a WebRTC call and during a browser call, a client that
stops reading, a caller that vanishes mid-reply, and the engine stalled (SIGSTOP) while a caller streams audio.

One loopback server for the module (the echo *test fixture* engine: none of this needs speech, and the echo is
what shows a call works). Tests that kill or stall the engine wait for the server to be ready again first.
The browser call runs the frontend page in headless Chromium (tests/browser.py), its microphone a tone file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import websockets
from selenium.webdriver.remote.webdriver import WebDriver

from engine_bridge.ring import SEGMENT_PREFIX, SHM_DIR
from livekit_omni.live import wire
from media.webrtc import enable_loopback_ice
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.browser import launch_chromium, page_call, wait_until
from tests.conftest import ServerProcess, start_server
from tests.speech_fixtures import write_wav
from tests.test_browser_e2e import Timeline, connect, hang_up, notice, open_page
from tests.test_live_lifecycle import tone, wait_engine_idle
from tests.test_live_webrtc import loud_frames, next_message, post, tone48k

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): killed and stalled processes.
pytestmark = pytest.mark.slow

#: The outbound queue of a Live WebSocket, small here so a client that stops reading fills it in seconds.
OUTBOUND_QUEUE_EVENTS = 32
#: Input burst allowance: also sizes the ingress ring (max(4 s, burst + 1 s)), so 4 s here.
INPUT_BURST_S = 1.0
INGRESS_RING_S = 4.0


#: Short, so the vanished caller's session is freed within the test (the default is 30 s).
RESUME_GRACE_S = 2.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    enable_loopback_ice()  # the aiortc callers of this process gather 127.0.0.1 only
    s = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
            "LIVEKIT_OMNI_LIMITS__OUTBOUND_QUEUE_EVENTS": str(OUTBOUND_QUEUE_EVENTS),
            "LIVEKIT_OMNI_LIMITS__INPUT_BURST_S": str(INPUT_BURST_S),
            # A vanished caller's session is kept this long for a resume (tests/test_resume.py), then freed.
            "LIVEKIT_OMNI_RESUME_GRACE_S": str(RESUME_GRACE_S),
        },
    )
    yield s
    s.stop()


# --- helpers ----------------------------------------------------------------------------------------------------


def segments_of(pid: int) -> set[str]:
    """Ring segments in /dev/shm created by process ``pid`` (names are ``lko_<creator pid>_<token>_<in|out>``)."""
    return {p.name for p in SHM_DIR.glob(f"{SEGMENT_PREFIX}{pid}_*")}


async def wait_for(probe: Any, what: str, timeout: float = 20.0, poll: float = 0.1) -> Any:
    """Poll ``probe()`` (sync, run off the loop) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(probe)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}; last: {value!r}")
        await asyncio.sleep(poll)


async def wait_new_engine(server: ServerProcess, old_pid: int, timeout: float = 60.0) -> int:
    """Until the supervisor has a new engine (another pid) ready; returns its pid."""

    def ready_other() -> int | None:
        code, body = server.health()
        pid = body.get("engine", {}).get("pid")
        return int(pid) if code == 200 and pid and pid != old_pid else None

    pid: int = await wait_for(ready_other, "a new engine", timeout)
    return pid


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics (0 when absent)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    key = name + (f"{{{labels}}}" if labels else "")
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


async def ensure_running(server: ServerProcess) -> None:
    """A test that failed while the engine was stopped must not leave it stopped for the next one."""
    _, body = await asyncio.to_thread(server.health)
    pid = body.get("engine", {}).get("pid")
    if pid:
        try:
            os.kill(int(pid), signal.SIGCONT)
        except ProcessLookupError:
            pass


async def webrtc_call(server: ServerProcess, caller: WebRTCCaller, seen: list[dict[str, Any]]) -> str:
    status, body = await post(
        server, {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await caller.offer()}}
    )
    assert status == 200, body
    await caller.accept(body["transport"]["sdp"])
    await asyncio.wait_for(caller.opened.wait(), 15)
    await next_message(caller, seen, "session.started")
    return str(body["session"]["id"])


async def wait_echo(caller: WebRTCCaller, frames: int = 25, timeout: float = 15.0) -> None:
    """Until ``frames`` loud 20 ms frames (the echoed tone) have come back on the track."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if caller.rate and len(loud_frames(caller.received_audio(), caller.rate)) >= frames:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError("no echo came back on the track")


# --- 1. engine kill -9 during a WebRTC call ---------------------------------------------------------------------


async def test_engine_killed_during_a_webrtc_call(server: ServerProcess) -> None:
    await ensure_running(server)
    await wait_engine_idle(server, timeout=60)
    server_pid = server.proc.pid
    before = segments_of(server_pid)
    restarts = metric(server, "livekit_omni_engine_restarts")
    engine_pid = server.engine_pid()
    caller = WebRTCCaller(tone48k(0.5), loop=True)
    seen: list[dict[str, Any]] = []
    try:
        await webrtc_call(server, caller, seen)
        await wait_echo(caller)
        during = segments_of(server_pid) - before
        assert len(during) == 2 and {n.rsplit("_", 1)[1] for n in during} == {"in", "out"}, during

        os.kill(engine_pid, signal.SIGKILL)
        err = await next_message(caller, seen, "error")
        assert err["error"]["code"] == "engine_lost" and err["error"]["type"] == "server_error", err
        closed = await next_message(caller, seen, "session.closed")
        assert closed["reason"] == "connection_lost"
        assert [e["type"] for e in seen].index("error") < [e["type"] for e in seen].index("session.closed")
        # The server hangs up: the data channel and the peer connection close (no waiting for ICE consent).
        assert caller.channel is not None
        await wait_for(lambda: caller.channel.readyState == "closed", "the data channel to close", 15)
        await wait_for(
            lambda: caller.pc.connectionState in ("closed", "failed"), "the peer connection to end", 15
        )
        # No ring segment of the dead engine's session is left.
        await wait_for(lambda: not (segments_of(server_pid) - before), "the session's segments to go", 15)
    finally:
        await caller.close()

    await wait_new_engine(server, engine_pid)
    assert metric(server, "livekit_omni_engine_restarts") == restarts + 1
    await wait_engine_idle(server)
    caller = WebRTCCaller(tone48k(0.5), loop=True)
    seen = []
    try:
        await webrtc_call(server, caller, seen)
        await wait_echo(caller)
        caller.send(json.dumps({"type": "session.close"}))
        assert (await next_message(caller, seen, "session.closed"))["reason"] == "close_requested"
    finally:
        await caller.close()
    await wait_for(lambda: not (segments_of(server_pid) - before), "the second call's segments to go", 15)


# --- 2. engine kill -9 during a browser call --------------------------------------------------------------------


def _remote_loud(driver: WebDriver) -> bool:
    """The page's received-audio timeline of this call has the echoed tone in it."""
    tl = Timeline.pull(driver)
    return bool(tl.remote.size and tl.remote.max() > -30)


def _wait_new_engine_sync(server: ServerProcess, old_pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        code, body = server.health()
        eng = body.get("engine", {})
        if code == 200 and eng.get("pid") not in (None, old_pid) and eng.get("active_sessions") == 0:
            return
        assert time.monotonic() < deadline, f"no new idle engine: {body}"
        time.sleep(0.2)


@pytest.mark.browser
def test_engine_killed_during_a_browser_call(server: ServerProcess, output_dir: Path) -> None:
    """The page shows why the call ended (the engine stopped), and pressing Connect again starts a call that gets
    audio, once the supervisor has a new engine. No ring segment of the killed call is left."""
    wav = output_dir / "fake-mic.wav"
    # 1 s of silence (ICE connects meanwhile), 8 s of tone, silence. Every new capture plays it from the start.
    t = np.arange(8 * 48_000) / 48_000
    tone_pcm = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    write_wav(
        wav, np.concatenate([np.zeros(48_000, np.int16), tone_pcm, np.zeros(20 * 48_000, np.int16)]), 48_000
    )
    _wait_new_engine_sync(server, old_pid=-1)
    server_pid = server.proc.pid
    before = segments_of(server_pid)
    engine_pid = server.engine_pid()
    with launch_chromium(output_dir, fake_mic_wav=wav) as driver:
        open_page(driver, server, key=None)
        connect(driver)
        wait_until(driver, _remote_loud, timeout=20, what="the echo of the mic in the page")
        assert len(segments_of(server_pid) - before) == 2

        os.kill(engine_pid, signal.SIGKILL)
        shown = notice(driver, timeout=20)
        driver.save_screenshot(str(output_dir / "browser-engine-lost.png"))
        assert shown["code"] == "engine_lost" and "voice engine stopped" in shown["text"], shown
        assert "Press Connect" in shown["text"]
        status = page_call(driver, "status")
        assert not status["connected"], status
        assert [e["code"] for e in page_call(driver, "errors")] == ["engine_lost"]
        deadline = time.monotonic() + 15
        while segments_of(server_pid) - before:
            assert time.monotonic() < deadline, segments_of(server_pid) - before
            time.sleep(0.1)

        # Connect works again once the new engine is up (a person would retry after the notice).
        _wait_new_engine_sync(server, engine_pid)
        connect(driver)
        assert page_call(driver, "status")["notice"] is None  # the old notice is cleared
        wait_until(driver, _remote_loud, timeout=20, what="audio in the second call")
        driver.save_screenshot(str(output_dir / "browser-reconnected.png"))
        hang_up(driver)
    deadline = time.monotonic() + 15
    while segments_of(server_pid) - before:
        assert time.monotonic() < deadline, segments_of(server_pid) - before
        time.sleep(0.1)


# --- 3. a client that stops reading -----------------------------------------------------------------------------


async def test_a_client_that_stops_reading_is_dropped_with_1013(server: ServerProcess) -> None:
    """The server keeps streaming audio to a client that reads nothing. Its outbound queue (32 events here) fills,
    the session is dropped (engine session freed) with no event (it would not be read), the backlog is let go, and
    the client, reading again, gets what the sockets held (bounded) and then close 1013. Another session streams on
    undisturbed."""
    await ensure_running(server)
    await wait_engine_idle(server, timeout=60)
    proc = psutil.Process(server.proc.pid)
    log_start = server.log_path.stat().st_size
    # A small receive buffer and segment size, so what the kernels hold for the client is small next to the
    # server's own queue (on loopback the 64 KiB segments let the server's send buffer grow to megabytes).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    # max_queue=1: the client library buffers one frame, then stops reading the socket too.
    stuck = await websockets.connect(
        server.ws_url + "/v1/live/sessions", sock=sock, max_queue=1, compression=None
    )
    other = await LiveClient.connect(server.url, keep_audio=False)
    try:
        assert isinstance(await other.start(), wire.SessionStarted)
        await stuck.send(json.dumps({"type": "session.start", "session": {"model": "m"}}))
        assert json.loads(await asyncio.wait_for(stuck.recv(), 10))["type"] == "session.started"
        rss0 = proc.memory_info().rss
        t0 = time.monotonic()
        # From here on `stuck` reads nothing; the server streams audio (silence, 100 ms a message) to both.
        await wait_for(
            lambda: server.health()[1]["engine"].get("active_sessions") == 1,
            "the server to drop the client that stopped reading",
            timeout=35,  # 32 x 100 ms plus the socket buffers; uvicorn's ping timeout (40 s) would be later
            poll=0.2,
        )
        took = time.monotonic() - t0
        rss_growth = proc.memory_info().rss - rss0
        log = server.log_path.read_bytes()[log_start:].decode(errors="replace")
        assert "client stopped reading" in log, log[-2000:]
        assert rss_growth < 20e6, rss_growth

        # Reading again: what the sockets held when it was dropped (its queue was let go), then 1013, no event.
        received = 0
        types: set[str] = set()
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                msg = await asyncio.wait_for(stuck.recv(), 10)
                received += len(msg)
                types.add(json.loads(msg)["type"])
        assert stuck.close_code == 1013, (stuck.close_code, stuck.close_reason)
        assert types <= {"session.output_audio.delta", "session.usage.updated"}, types
        assert received < 1_000_000, received  # bounded: a few socket buffers, not the whole backlog

        # The other session never stalled and lives on.
        arrivals = [t for t, _ in other.deltas if t >= t0]
        assert arrivals and arrivals[-1] - arrivals[0] >= took - 1.0
        assert max(np.diff(arrivals)) < 1.0, max(np.diff(arrivals))
        await other.send({"type": "session.close"})
        assert (await other.next_event(wire.SessionClosed)).reason == "close_requested"
    finally:
        await stuck.close()
        await other.close()


# --- 4. a caller that vanishes mid-reply ------------------------------------------------------------------------


async def test_a_caller_that_vanishes_mid_reply_frees_its_session(server: ServerProcess) -> None:
    """The caller's socket is reset (no close frame, no session.close) while the model is speaking (the echo is
    playing): the session is kept for a resume for ``resume_grace_s`` (short here), then the engine session is
    closed, its ring segments go, and the server serves the next caller."""
    await ensure_running(server)
    await wait_engine_idle(server, timeout=60)
    server_pid = server.proc.pid
    before = segments_of(server_pid)
    detached_before = metric(server, "livekit_omni_sessions_detached_total")
    c = await LiveClient.connect(server.url)
    send_task: asyncio.Task[None] | None = None
    try:
        assert isinstance(await c.start(), wire.SessionStarted)
        assert len(segments_of(server_pid) - before) == 2
        send_task = asyncio.create_task(c.append_audio(tone(3.0), bytes_per_100ms=4800))

        def speaking() -> bool:
            out = np.frombuffer(bytes(c.audio[-4800:]), dtype="<i2")
            return out.size > 0 and int(np.abs(out).max()) > 4000

        await wait_for(speaking, "the echo to play", 10, poll=0.02)
        # Vanish: SO_LINGER 0 makes close() send a TCP reset; nothing else goes out.
        sock = c.ws.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        send_task.cancel()
        c.ws.transport.abort()
    finally:
        if send_task is not None:
            send_task.cancel()
        await c.close()
    await wait_for(
        lambda: metric(server, "livekit_omni_sessions_detached_total") > detached_before,
        "the session to be kept for a resume",
        10,
    )
    await wait_engine_idle(server, timeout=15 + RESUME_GRACE_S)
    await wait_for(lambda: not (segments_of(server_pid) - before), "the session's segments to go", 15)
    assert metric(server, "livekit_omni_active_sessions", 'transport="websocket"') == 0
    code, body = await asyncio.to_thread(server.health)
    assert code == 200 and body["status"] == "ok", body
    # The next caller is served.
    c = await LiveClient.connect(server.url)
    try:
        assert isinstance(await c.start(), wire.SessionStarted)
        await c.append_audio(tone(0.4) + bytes(4800 * 4), bytes_per_100ms=4800)
        assert np.abs(np.frombuffer(bytes(c.audio), dtype="<i2")).max() > 4000
        await c.send({"type": "session.close"})
        assert (await c.next_event(wire.SessionClosed)).reason == "close_requested"
    finally:
        await c.close()


# --- 5. ring overrun under a stalled engine ---------------------------------------------------------------------


async def test_a_stalled_engine_overruns_the_ingress_ring_then_the_session_recovers(
    server: ServerProcess,
) -> None:
    """SIGSTOP the engine while the caller streams at real time. The ingress ring (4 s here) fills; the ring never
    overwrites, so the newest audio is refused and counted (/metrics), the server's memory does not grow, and the
    session stays open. After SIGCONT the engine drains the ring and a tone spoken then is echoed back."""
    await ensure_running(server)
    await wait_engine_idle(server, timeout=60)
    proc = psutil.Process(server.proc.pid)
    engine_pid = server.engine_pid()
    overruns0 = metric(server, "livekit_omni_ring_overruns_total", 'ring="ingress"')
    dropped0 = metric(server, "livekit_omni_ingress_dropped_seconds_total")
    c = await LiveClient.connect(server.url)
    stopped = False
    try:
        assert isinstance(await c.start(), wire.SessionStarted)
        await c.append_audio(bytes(4800 * 5), bytes_per_100ms=4800)  # the session runs
        rss0 = proc.memory_info().rss
        os.kill(engine_pid, signal.SIGSTOP)
        stopped = True
        stall_s = INGRESS_RING_S + 3.0
        await c.append_audio(bytes(int(4800 * stall_s * 10)), bytes_per_100ms=4800)  # real time, silence
        overruns = metric(server, "livekit_omni_ring_overruns_total", 'ring="ingress"') - overruns0
        dropped_s = metric(server, "livekit_omni_ingress_dropped_seconds_total") - dropped0
        rss_growth = proc.memory_info().rss - rss0
        # What did not fit: the stall minus the ring, in 20 ms pieces (loose bounds: the ring held some audio when
        # the stall began, and appends on a loaded machine arrive late).
        assert 1.0 <= dropped_s <= stall_s - INGRESS_RING_S + 1.0, dropped_s
        assert overruns == pytest.approx(dropped_s / 0.02, abs=2), (overruns, dropped_s)
        assert rss_growth < 20e6, rss_growth
        assert not c.closed.is_set() and not c.of(wire.Error), c.events
        assert c.of(wire.SessionClosed) == []

        os.kill(engine_pid, signal.SIGCONT)
        stopped = False
        # The engine drains the backlog (stale silence) and goes on: a tone now comes back.
        heard_from = len(c.audio)
        await c.append_audio(tone(0.5), bytes_per_100ms=4800)

        def echoed() -> bool:
            out = np.frombuffer(bytes(c.audio[heard_from:]), dtype="<i2")
            return out.size > 0 and int(np.abs(out).max()) > 4000

        async def keep_streaming() -> None:
            while True:
                await c.append_audio(bytes(4800), bytes_per_100ms=4800)

        feeder = asyncio.create_task(keep_streaming())
        try:
            await wait_for(echoed, "the tone's echo after the stall", timeout=20, poll=0.05)
        finally:
            feeder.cancel()
        assert server.engine_pid() == engine_pid  # the same engine: nothing was restarted
        assert not c.of(wire.Error), c.of(wire.Error)
        await c.send({"type": "session.close"})
        assert (await c.next_event(wire.SessionClosed)).reason == "close_requested"
    finally:
        if stopped:
            os.kill(engine_pid, signal.SIGCONT)
        await c.close()
