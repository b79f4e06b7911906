"""Session resume after a dropped connection, against real ``livekit-omni serve`` processes.

Their engines run the loopback echo *test fixture* (no models). That is enough here because resume lives wholly in
the HTTP process: a detached session keeps its engine session open, untouched, so whatever that session holds (the
loopback's timeline, a model's KV and token log) is kept by the same fact the tests check through the engine's own
counts in /health: the engine session was never closed and no new one was opened. The echo gives output whose
arrival can be checked (pending output after a drop) without a model.

Drops are real: the client's TCP connection is aborted (no close frame, no ``session.close``), or for the plugin a
TCP relay between it and the server is cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import numpy as np
import pytest
from livekit import rtc
from livekit.agents import llm
from prometheus_client.parser import text_string_to_metric_families

from livekit_omni import OmniDuplexModel
from livekit_omni.live import wire
from livekit_omni.plugin.remote import RemoteSession
from media.webrtc import enable_loopback_ice
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import ServerProcess, start_server

API_KEY = "sk-resume"
#: The short-grace server: its detached sessions live this long.
SHORT_GRACE_S = 3.0
#: ... and may keep this much output (the smallest the setting allows): PCM16 24 kHz output (~65 KB/s encoded)
#: overflows it in about a second, G.711 output (~11 KB/s) outlasts the grace.
SMALL_BUFFER_BYTES = 64 * 1024
PCM_100MS = 4800  # bytes of PCM16 24 kHz


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server(adapter="loopback", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def short_grace_server() -> Iterator[ServerProcess]:
    srv = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_RESUME_GRACE_S": str(SHORT_GRACE_S),
            "LIVEKIT_OMNI_LIMITS__RESUME_BUFFER_BYTES": str(SMALL_BUFFER_BYTES),
        },
    )
    yield srv
    srv.stop()


def tone(seconds: float, rate: int = 24000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2")


def energy(pcm: bytes | np.ndarray) -> float:
    a = np.frombuffer(pcm, dtype="<i2") if isinstance(pcm, bytes | bytearray) else pcm
    return float(np.sum(a.astype(np.float64) ** 2))


def engine_counts(server: ServerProcess) -> tuple[int, int]:
    """(sessions open in the engine, sessions it ever opened), from the engine's own figures in /health."""
    engine = server.health()[1]["engine"]
    return int(engine["active_sessions"]), int(engine["opened_sessions"])


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    req = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


async def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def connect(server: ServerProcess) -> LiveClient:
    return await LiveClient.connect(server.url, api_key=API_KEY)


async def start_session(
    server: ServerProcess, session: dict[str, object] | None = None
) -> tuple[LiveClient, wire.SessionStarted]:
    c = await connect(server)
    ev = await c.start(session or {"model": "m"})
    assert isinstance(ev, wire.SessionStarted), ev
    assert ev.resume_token, "session.started carries a resume token"
    return c, ev


def drop(c: LiveClient) -> None:
    """The connection dies: the TCP socket is aborted, no close frame, no session.close."""
    c.ws.transport.abort()


async def detached(server: ServerProcess, before: float) -> None:
    await until(
        lambda: metric(server, "livekit_omni_sessions_detached_total") > before, 10, "the session to detach"
    )


async def test_a_dropped_session_resumes_with_its_engine_session_timeline_and_pending_output(
    server: ServerProcess,
) -> None:
    c1, st1 = await start_session(server)
    sid, token1 = st1.session.id, st1.resume_token
    assert token1 is not None
    engine_before = engine_counts(server)
    detached_before = metric(server, "livekit_omni_sessions_detached_total")
    resumed_before = metric(server, "livekit_omni_sessions_resumed_total")
    # 2 s of tone at once (within the burst allowance): the loopback echoes it 200 ms later, released by the next
    # input, so after that 100 ms nudge the whole echo is queued in the session's output, played out at real time.
    await c1.append_audio(tone(2.0).tobytes(), bytes_per_100ms=PCM_100MS, realtime=False)
    await c1.send(
        {"type": "session.thinking.append", "event_id": "a1", "content": "x", "delegation_id": None}
    )
    a1 = await c1.next_event(wire.ThinkingAppended)
    await asyncio.sleep(0.4)
    await c1.append_audio(bytes(PCM_100MS), bytes_per_100ms=PCM_100MS, realtime=False)
    await asyncio.sleep(0.05)
    drop(c1)
    heard_before = energy(bytes(c1.audio))
    await detached(server, detached_before)
    # While no client is connected the engine session stays open, and nothing new was opened.
    assert engine_counts(server) == engine_before
    await asyncio.sleep(2.5)  # the echo plays out while detached: it is kept, not lost

    c2 = await connect(server)
    try:
        st2 = await c2.resume(token1)
        assert isinstance(st2, wire.SessionStarted), st2
        assert st2.session.id == sid and st2.client_event_id == "resume"
        assert st2.resume_token and st2.resume_token != token1, "each (re)attach issues a fresh token"
        assert metric(server, "livekit_omni_sessions_resumed_total") == resumed_before + 1
        # The pending output arrives on the new connection: the echo that was not heard before the drop.
        tone_energy = energy(tone(2.0))
        await until(lambda: energy(bytes(c2.audio)) + heard_before >= 0.7 * tone_energy, 10, "the kept echo")
        assert energy(bytes(c2.audio)) >= 0.5 * tone_energy
        # Nothing is sent twice (some may be lost in the dropped socket; nothing is repeated).
        await asyncio.sleep(0.5)
        assert (energy(bytes(c2.audio)) + heard_before) / tone_energy <= 1.05
        # The conversation goes on, on the same timeline: the new append lands after the first.
        await c2.send(
            {"type": "session.thinking.append", "event_id": "a2", "content": "y", "delegation_id": None}
        )
        a2 = await c2.next_event(wire.ThinkingAppended)
        # (A new session's timeline would start at 0; this one has the 2.1 s sent before the drop.)
        assert a2.start_ms >= max(a1.start_ms, 2000), (a1, a2)
        got = len(c2.audio)
        await c2.append_audio(tone(0.6).tobytes(), bytes_per_100ms=PCM_100MS)
        await c2.append_audio(bytes(PCM_100MS * 5), bytes_per_100ms=PCM_100MS)
        assert energy(bytes(c2.audio[got:])) >= 0.8 * energy(tone(0.6)), "the new audio is echoed"
        assert engine_counts(server) == engine_before, "still the same engine session"
        await c2.send({"type": "session.close", "event_id": "bye"})
        closed = await c2.next_event(wire.SessionClosed)
        assert closed.session.id == sid and closed.reason == "close_requested"
        assert await c2.wait_closed() == 1000
        await until(
            lambda: engine_counts(server) == (engine_before[0] - 1, engine_before[1]), 10, "the engine close"
        )
    finally:
        await c1.close()
        await c2.close()


async def test_a_token_resumes_once_and_unknown_tokens_are_refused(server: ServerProcess) -> None:
    c1, st1 = await start_session(server)
    token1 = st1.resume_token
    assert token1 is not None
    before = metric(server, "livekit_omni_sessions_detached_total")
    drop(c1)
    await detached(server, before)
    c2 = await connect(server)
    c3 = await connect(server)
    try:
        st2 = await c2.resume(token1)
        assert isinstance(st2, wire.SessionStarted) and st2.session.id == st1.session.id
        # A second use: refused with a typed error, and the connection stays usable for a new session.
        again = await c3.resume(token1)
        assert isinstance(again, wire.Error) and again.error.code == "resume_token_used", again
        assert again.error.param == "resume_token" and again.error.client_event_id == "resume"
        unknown = await c3.resume("not-a-token")
        assert isinstance(unknown, wire.Error) and unknown.error.code == "resume_token_invalid", unknown
        assert metric(server, "livekit_omni_resume_refused_total", code="resume_token_used") >= 1
        fresh = await c3.start()
        assert isinstance(fresh, wire.SessionStarted) and fresh.session.id != st1.session.id
        # session.resume only opens a connection: on a started one it is refused.
        await c3.send({"type": "session.resume", "event_id": "late", "resume_token": fresh.resume_token})
        late = await c3.next_event(wire.Error)
        assert late.error.code == "session_already_started", late
    finally:
        for c in (c1, c2, c3):
            await c.close()


async def test_the_resuming_connection_must_authenticate(server: ServerProcess) -> None:
    c1, st1 = await start_session(server)
    try:
        intruder = await LiveClient.connect(server.url, api_key="sk-wrong")
        assert st1.resume_token is not None
        with contextlib.suppress(Exception):
            await intruder.send({"type": "session.resume", "event_id": "r", "resume_token": st1.resume_token})
        ev = await intruder.next_event(wire.Error)
        assert ev.error.code == "invalid_api_key"
        assert await intruder.wait_closed() == 1008
        await intruder.close()
        # The token was not spent by the refused connection: the session is still the caller's.
        drop(c1)
        c2 = await connect(server)
        try:
            st2 = await c2.resume(st1.resume_token)
            assert isinstance(st2, wire.SessionStarted) and st2.session.id == st1.session.id, st2
            await c2.send({"type": "session.close"})
            await c2.next_event(wire.SessionClosed)
        finally:
            await c2.close()
    finally:
        await c1.close()


async def test_an_unresumed_session_is_closed_after_the_grace(short_grace_server: ServerProcess) -> None:
    srv = short_grace_server
    # G.711 output: the grace runs out long before the (small) buffer would.
    c1, st1 = await start_session(srv, {"model": "m", "audio": {"format": {"type": "audio/pcmu"}}})
    assert st1.resume_token is not None
    active, opened = engine_counts(srv)
    expired_before = metric(srv, "livekit_omni_detached_sessions_ended_total", reason="expired")
    before = metric(srv, "livekit_omni_sessions_detached_total")
    drop(c1)
    await detached(srv, before)
    t_detached = time.monotonic()
    await until(lambda: engine_counts(srv) == (active - 1, opened), SHORT_GRACE_S + 10, "the engine close")
    assert time.monotonic() - t_detached >= SHORT_GRACE_S - 0.5, "closed before the grace was over"
    assert metric(srv, "livekit_omni_detached_sessions_ended_total", reason="expired") == expired_before + 1
    c2 = await connect(srv)
    try:
        ev = await c2.resume(st1.resume_token)
        assert isinstance(ev, wire.Error) and ev.error.code == "resume_token_invalid", ev
    finally:
        await c1.close()
        await c2.close()


async def test_a_detached_session_over_the_buffer_bound_is_closed(short_grace_server: ServerProcess) -> None:
    srv = short_grace_server
    c1, st1 = await start_session(srv)  # PCM16 24 kHz output: ~65 KB/s against a 64 KiB buffer
    assert st1.resume_token is not None
    active, opened = engine_counts(srv)
    overflow_before = metric(srv, "livekit_omni_detached_sessions_ended_total", reason="overflow")
    expired_before = metric(srv, "livekit_omni_detached_sessions_ended_total", reason="expired")
    drop(c1)
    await until(
        lambda: (
            metric(srv, "livekit_omni_detached_sessions_ended_total", reason="overflow") > overflow_before
        ),
        SHORT_GRACE_S + 10,
        "the overflow",
    )
    assert metric(srv, "livekit_omni_detached_sessions_ended_total", reason="expired") == expired_before
    await until(lambda: engine_counts(srv) == (active - 1, opened), 10, "the engine close")
    c2 = await connect(srv)
    try:
        ev = await c2.resume(st1.resume_token)
        assert isinstance(ev, wire.Error) and ev.error.code == "resume_token_invalid", ev
    finally:
        await c1.close()
        await c2.close()


class Relay:
    """A TCP relay on loopback between a client and the server, whose connections the test can cut (a network
    drop: both ends see the connection die, neither sends a close frame)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self.connections = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


async def test_the_plugins_remote_mode_resumes_instead_of_reseeding(server: ServerProcess) -> None:
    relay = Relay(server.port)
    await relay.start()
    model = OmniDuplexModel(base_url=f"http://127.0.0.1:{relay.port}/v1", api_key=API_KEY)
    s = model.session()
    assert isinstance(s, RemoteSession)
    events: list[wire.ClientCommand] = []
    reconnected: list[object] = []
    s.on("omni_client_event", events.append)
    s.on("session_reconnected", reconnected.append)
    received: list[float] = []

    async def read_output() -> None:
        async for f in s.audio_stream:
            received.append(energy(np.frombuffer(bytes(f.frame.data), dtype=np.int16)))

    reader = asyncio.create_task(read_output())
    try:
        ctx = llm.ChatContext.empty()
        ctx.add_message(role="user", content="My name is Bob.", id="u1")
        await s._update_session(instructions="Be brief.", chat_ctx=ctx, tools=[])
        assert await asyncio.wait_for(s.wait_ready(), 10)
        first = s.session_id
        engine_before = engine_counts(server)
        relay.cut()
        await until(lambda: bool(reconnected) and s._session_started.is_set(), 20, "the reconnect")
        assert s.session_id == first, "the same server session"
        assert s.resumes == 1 and s.resumes_refused == 0
        assert len([e for e in events if isinstance(e, wire.SessionStart)]) == 1, "no re-seeded session.start"
        assert len([e for e in events if isinstance(e, wire.SessionResume)]) == 1
        assert engine_counts(server) == engine_before
        # The resumed session works: its echo comes back through the plugin.
        before = sum(received)
        for _ in range(40):
            s.push_audio(rtc.AudioFrame(tone(0.02).tobytes(), 24_000, 1, 480))
            await asyncio.sleep(0.02)
        await until(lambda: sum(received) - before >= 0.5 * energy(tone(0.8)), 10, "the echo after resume")
    finally:
        await s.aclose()
        await model.aclose()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await relay.close()


async def test_the_plugin_starts_afresh_when_the_session_cannot_be_resumed(
    short_grace_server: ServerProcess,
) -> None:
    """The drop outlasts the grace: the resume is refused, and the plugin starts a new session on the same
    connection, re-seeded with the conversation (what it did before resume existed)."""
    srv = short_grace_server
    relay = Relay(srv.port)
    await relay.start()
    model = OmniDuplexModel(
        base_url=f"http://127.0.0.1:{relay.port}/v1", api_key=API_KEY, max_retries=20, retry_interval_s=0.5
    )
    s = model.session()
    assert isinstance(s, RemoteSession)
    events: list[wire.ClientCommand] = []
    s.on("omni_client_event", events.append)

    def ended() -> float:
        return sum(
            metric(srv, "livekit_omni_detached_sessions_ended_total", reason=r)
            for r in ("expired", "overflow")
        )

    try:
        ctx = llm.ChatContext.empty()
        ctx.add_message(role="user", content="My name is Bob.", id="u1")
        await s._update_session(instructions="Be brief.", chat_ctx=ctx, tools=[])
        assert await asyncio.wait_for(s.wait_ready(), 10)
        first = s.session_id
        ended_before = ended()
        # Keep the relay refusing (its upstream is gone) long enough for the grace to run out: the relay's server
        # stops accepting, so the plugin's retries fail until it reopens.
        assert relay._server is not None
        relay._server.close()
        relay.cut()
        await until(lambda: ended() > ended_before, SHORT_GRACE_S + 15, "the detached session to end")
        relay._server = await asyncio.start_server(relay._handle, "127.0.0.1", relay.port)
        await until(
            lambda: s._session_started.is_set() and s.session_id not in (None, first), 30, "a new session"
        )
        assert s.resumes_refused == 1
        starts = [e for e in events if isinstance(e, wire.SessionStart)]
        assert len(starts) == 2
        assert [(i.role, i.content[0].text) for i in starts[1].session.input or []] == [
            ("user", "My name is Bob.")
        ]
    finally:
        await s.aclose()
        await model.aclose()
        await relay.close()


async def test_a_client_that_closes_the_socket_ends_its_session(server: ServerProcess) -> None:
    """A close frame (1000) is a client leaving on purpose: the session ends at once, nothing is kept."""
    c1, st1 = await start_session(server)
    active, opened = engine_counts(server)
    detached_before = metric(server, "livekit_omni_sessions_detached_total")
    await c1.ws.close(1000)
    await until(lambda: engine_counts(server) == (active - 1, opened), 10, "the engine close")
    assert metric(server, "livekit_omni_sessions_detached_total") == detached_before
    c2 = await connect(server)
    try:
        assert st1.resume_token is not None
        ev = await c2.resume(st1.resume_token)
        assert isinstance(ev, wire.Error) and ev.error.code == "resume_token_invalid", ev
    finally:
        await c1.close()
        await c2.close()


async def test_the_drain_ends_detached_sessions_at_once() -> None:
    """SIGTERM with only a detached session: nobody can finish it, so the drain ends it and the server exits
    long before either grace (drain 60 s, resume 30 s)."""
    srv = start_server(
        adapter="loopback",
        env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]), "LIVEKIT_OMNI_DRAIN_GRACE_S": "60"},
    )
    try:
        c1, _ = await start_session(srv)
        before = metric(srv, "livekit_omni_sessions_detached_total")
        drop(c1)
        await detached(srv, before)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(srv.proc.wait, 25)
        assert code == 0
        assert time.monotonic() - t0 < 20, "the drain waited for the detached session"
        await c1.close()
    finally:
        srv.stop()


# --- WebRTC: an ICE failure / consent loss detaches; a new offer with the token re-attaches ----------------------


@pytest.fixture(scope="module")
def webrtc_server() -> Iterator[ServerProcess]:
    enable_loopback_ice()  # the client side of this process gathers 127.0.0.1 only
    srv = start_server(
        adapter="loopback",
        env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]), "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true"},
    )
    yield srv
    srv.stop()


def tone48k(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * 48000)) / 48000
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)


async def offer(server: ServerProcess, body: dict[str, object]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            server.url + "/v1/live/sessions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as r,
    ):
        return r.status, await r.json()


async def channel_event(caller: WebRTCCaller, type_: str, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        while caller.messages:
            ev = json.loads(caller.messages.popleft())
            if ev["type"] == type_:
                return dict(ev)
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no {type_} on the data channel")


def cut_network(caller: WebRTCCaller) -> None:
    """The caller's network dies: its ICE sockets close without a word (no DTLS close, no SCTP abort), so the
    server hears nothing more and its ICE consent checks fail, as when a phone loses its connection."""
    sctp = caller.pc.sctp
    assert sctp is not None
    connection = sctp.transport.transport._connection  # aioice's Connection under the ICE transport
    for protocol in list(connection._protocols):
        if protocol.transport is not None:
            protocol.transport.close()


@pytest.mark.slow  # an ICE failure takes ~35 s to be noticed
async def test_webrtc_ice_failure_detaches_and_a_new_offer_with_the_token_resumes(
    webrtc_server: ServerProcess,
) -> None:
    srv = webrtc_server
    first = WebRTCCaller(loop=False)
    second = WebRTCCaller(np.concatenate([np.zeros(24000, np.int16), tone48k(1.0)]), loop=False)
    try:
        status, body = await offer(
            srv, {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await first.offer()}}
        )
        assert status == 200, body
        sid = body["session"]["id"]
        await first.accept(body["transport"]["sdp"])
        await asyncio.wait_for(first.opened.wait(), 10)
        started = await channel_event(first, "session.started")
        token = started["resume_token"]
        assert started["session"]["id"] == sid and isinstance(token, str) and token
        engine_before = engine_counts(srv)
        before = metric(srv, "livekit_omni_sessions_detached_total")
        cut_network(first)
        # ICE consent expires after about 30 s of silence (aioice: 6 checks, 5 s apart): then "failed".
        await until(lambda: metric(srv, "livekit_omni_sessions_detached_total") > before, 60, "the detach")
        assert engine_counts(srv) == engine_before, "the engine session is kept"

        status, body = await offer(
            srv, {"resume_token": token, "transport": {"type": "webrtc", "sdp": await second.offer()}}
        )
        assert status == 200, body
        assert body["session"]["id"] == sid
        await second.accept(body["transport"]["sdp"])
        await asyncio.wait_for(second.opened.wait(), 10)
        again = await channel_event(second, "session.started")
        assert again["session"]["id"] == sid and again["resume_token"] not in (None, token)
        # The same engine session hears the new peer: its echo comes back on the new track.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            pcm = second.received_audio()
            if second.rate and energy(pcm) >= 0.5 * energy(tone48k(1.0)):
                break
        assert energy(second.received_audio()) >= 0.5 * energy(tone48k(1.0)), "no echo after the resume"
        assert engine_counts(srv) == engine_before
        # The spent token is refused, typed.
        third = WebRTCCaller(loop=False)
        try:
            status, body = await offer(
                srv, {"resume_token": token, "transport": {"type": "webrtc", "sdp": await third.offer()}}
            )
            assert status == 400 and body["error"]["code"] == "resume_token_used", body
        finally:
            await third.close()
        second.send(json.dumps({"type": "session.close", "event_id": "bye"}))
        closed = await channel_event(second, "session.closed")
        assert closed["session"]["id"] == sid
        await until(
            lambda: engine_counts(srv) == (engine_before[0] - 1, engine_before[1]), 10, "the engine close"
        )
    finally:
        await first.close()
        await second.close()


async def test_a_resume_takes_over_a_connection_the_server_still_holds(server: ServerProcess) -> None:
    """The client lost its connection but the server has not noticed yet (a half-open TCP connection): the token
    still resumes the session; the old connection is closed (1000, ``session_resumed``) and left behind."""
    c1, st1 = await start_session(server)
    assert st1.resume_token is not None
    engine_before = engine_counts(server)
    c2 = await connect(server)
    try:
        st2 = await c2.resume(st1.resume_token)
        assert isinstance(st2, wire.SessionStarted) and st2.session.id == st1.session.id, st2
        assert await c1.wait_closed() == 1000 and c1.close_reason == "session_resumed"
        # The session lives on the new connection, on the same engine session.
        await c2.send({"type": "session.input_audio.mute", "event_id": "m"})
        assert (await c2.next_event(wire.InputAudioMuted)).client_event_id == "m"
        assert engine_counts(server) == engine_before
        await c2.send({"type": "session.close"})
        await c2.next_event(wire.SessionClosed)
    finally:
        await c1.close()
        await c2.close()
