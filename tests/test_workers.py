"""``livekit-omni serve --workers 2``: two facade/media processes on one port, sharing one engine (real processes).

The engine runs the loopback echo *test fixture* (no models): what is tested here is where sessions live and how
requests find them, none of which depends on the model. Which worker accepts a new connection is the kernel's
choice, so the tests that need a request to land on the *other* worker repeat it over fresh connections until the
relay counter (``livekit_omni_relayed_requests_total``) shows that one was relayed, and check every attempt works.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import numpy as np
import psutil
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from livekit_omni import worker_ids
from livekit_omni.live import wire
from livekit_omni.routing import merge_metrics
from livekit_omni.worker_ids import owner_of
from media.webrtc import enable_loopback_ice
from testkit.live_client import LiveClient
from testkit.webrtc_caller import WebRTCCaller
from tests.conftest import ServerProcess, start_server
from tests.test_realtime_webrtc import call, post_offer, wait_for_state
from tests.test_resume import channel_event, cut_network, energy, tone48k

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): several worker processes per test, an ICE failure of ~35 s.
pytestmark = pytest.mark.slow

API_KEY = "sk-workers"
MAX_SESSIONS = 4
DRAIN_GRACE_S = 3.0
PCM_100MS = 4800  # bytes of PCM16 24 kHz
#: Fresh connections tried before concluding the kernel never gives one to the other worker.
ATTEMPTS = 24
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_ids_carry_their_worker_only_when_there_are_several() -> None:
    assert worker_ids.current() is None and worker_ids.tagged("abc") == "abc"
    assert worker_ids.owner_of("live_0123abcd") is None and worker_ids.foreign_owner("live_0123abcd") is None
    try:
        worker_ids.set_current(worker_ids.WorkerIdentity(1, 3, "/tmp/x"))
        token = worker_ids.tagged("Zk_-w2abc")  # URL-safe base64 may hold "_", "-" and "w2" but never "."
        assert token == "w1.Zk_-w2abc" and worker_ids.owner_of(token) == 1
        assert worker_ids.owner_of("live_" + worker_ids.tagged("00ff")) == 1
        assert worker_ids.owner_of("ek_w2.x") == 2 and worker_ids.foreign_owner("ek_w2.x") == 2
        assert worker_ids.foreign_owner("sess_w1.ab") is None, "our own"
        assert worker_ids.foreign_owner("sess_w7.ab") is None, "no such worker"
        assert worker_ids.owner_of("sess_xw1.ab") is None and worker_ids.owner_of("w1") is None
    finally:
        worker_ids.set_current(None)


def test_workers_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from livekit_omni.cli import main

    assert main(["serve", "--workers", "0"]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err


def test_metrics_of_the_workers_merge_with_a_worker_label() -> None:
    one = '# HELP x_total X\n# TYPE x_total counter\nx_total{k="a"} 2.0\n# HELP g G\n# TYPE g gauge\ng 1.0\n'
    two = '# HELP x_total X\n# TYPE x_total counter\nx_total{k="a"} 5.0\n'
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(merge_metrics({0: one, 1: two}).decode())
        for s in fam.samples
    }
    assert samples == {
        ("x_total", (("k", "a"), ("worker", "0"))): 2.0,
        ("x_total", (("k", "a"), ("worker", "1"))): 5.0,
        ("g", (("worker", "0"),)): 1.0,
    }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    enable_loopback_ice()
    srv = start_server(
        adapter="loopback",
        extra_args=["--workers", "2"],
        env={
            "LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY]),
            "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": str(MAX_SESSIONS),
            "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
            "LIVEKIT_OMNI_DRAIN_GRACE_S": str(DRAIN_GRACE_S),
        },
    )
    wait_for_workers(srv)
    yield srv
    srv.stop()


def wait_for_workers(srv: ServerProcess, timeout: float = 60.0) -> None:
    """Until the parent says every worker is ready (the first /health 200 may come from one of them only)."""
    deadline = time.monotonic() + timeout
    while "(2 workers)" not in srv.log_path.read_text(errors="replace").split("engine ready:", 1)[-1]:
        assert time.monotonic() < deadline, srv.log_tail()
        time.sleep(0.1)


def tone(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()


async def metrics(srv: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as http, http.get(srv.url + "/metrics", headers=AUTH) as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def metric_sum(srv: ServerProcess, name: str, **labels: str) -> float:
    """``name`` summed over the workers (the samples whose labels include ``labels``)."""
    return sum(
        v
        for (n, lbl), v in (await metrics(srv)).items()
        if n == name and all(dict(lbl).get(k) == x for k, x in labels.items())
    )


async def relayed(srv: ServerProcess, kind: str) -> float:
    return await metric_sum(srv, "livekit_omni_relayed_requests_total", kind=kind)


async def started(srv: ServerProcess) -> tuple[LiveClient, wire.SessionStarted]:
    c = await LiveClient.connect(srv.url, api_key=API_KEY)
    ev = await c.start({"model": "m"})
    assert isinstance(ev, wire.SessionStarted), ev
    return c, ev


async def echoes(c: LiveClient) -> None:
    """The session works end to end: the loopback engine sends its audio back."""
    before = len(c.audio)
    await c.append_audio(tone(0.4) + bytes(PCM_100MS * 4), bytes_per_100ms=PCM_100MS)
    out = np.frombuffer(bytes(c.audio[before - before % 2 :]), dtype="<i2")
    assert out.size and np.abs(out).max() > 4000, "no echo"


async def on_both_workers(srv: ServerProcess, n: int) -> list[tuple[LiveClient, wire.SessionStarted]]:
    """``n`` open Live sessions, at least one on each worker (reconnecting the surplus until that holds)."""
    sessions = [await started(srv) for _ in range(n)]
    for _ in range(ATTEMPTS):
        owners = {owner_of(st.session.id) for _, st in sessions}
        if owners == {0, 1}:
            return sessions
        c, _ = sessions.pop()
        await c.close()
        await asyncio.sleep(0.1)  # the engine frees the slot once the closed session is gone
        sessions.append(await started(srv))
    raise AssertionError(f"every session landed on worker {owners}")


async def until_relayed(
    srv: ServerProcess, kind: str, attempt: Callable[[], Awaitable[Any]], what: str
) -> int:
    """Run ``attempt`` (each on fresh connections) until one of them was relayed; returns how many ran."""
    before = await relayed(srv, kind)
    for i in range(1, ATTEMPTS + 1):
        await attempt()
        if await relayed(srv, kind) > before:
            return i
    raise AssertionError(f"{ATTEMPTS} {what} never landed on the other worker")


async def test_sessions_land_on_both_workers_and_all_work(server: ServerProcess) -> None:
    code, health = server.health()
    assert code == 200 and health["worker"]["count"] == 2 and health["engine"]["attached"]
    sessions = await on_both_workers(server, 3)
    try:
        for c, st in sessions:
            assert st.session.id.startswith(("live_w0.", "live_w1."))
            await echoes(c)
        # /metrics shows both workers, whichever answered the scrape.
        opened = {
            w: await metric_sum(server, "livekit_omni_sessions_total", worker=w, transport="websocket")
            for w in ("0", "1")
        }
        assert all(v >= 1 for v in opened.values()), opened
        assert server.health()[1]["engine"]["active_sessions"] == 3, (
            "one engine holds every worker's sessions"
        )
    finally:
        for c, _ in sessions:
            await c.close()


async def test_admission_is_global_across_workers(server: ServerProcess) -> None:
    sessions = await on_both_workers(server, MAX_SESSIONS)
    try:
        refused_before = await metric_sum(server, "livekit_omni_errors_total", code="session_limit_reached")
        for _ in range(3):
            c = await LiveClient.connect(server.url, api_key=API_KEY)
            try:
                ev = await c.start({"model": "m"})
                assert isinstance(ev, wire.Error) and ev.error.code == "session_limit_reached", ev
            finally:
                await c.close()
        refused = await metric_sum(server, "livekit_omni_errors_total", code="session_limit_reached")
        assert refused >= refused_before + 3
        for c, _ in sessions:
            await echoes(c)  # the refusals took nothing from the open sessions
    finally:
        for c, _ in sessions:
            await c.close()


async def test_resume_works_whichever_worker_the_new_connection_reaches(server: ServerProcess) -> None:
    c, st = await started(server)
    sid, token = st.session.id, st.resume_token
    clients = [c]

    async def drop_and_resume() -> None:
        nonlocal token
        assert token is not None
        clients[-1].ws.transport.abort()  # no close frame: the session is kept for a resume
        await asyncio.sleep(0.3)
        c2 = await LiveClient.connect(server.url, api_key=API_KEY)
        clients.append(c2)
        ev = await c2.resume(token)
        assert isinstance(ev, wire.SessionStarted) and ev.session.id == sid, ev
        assert ev.resume_token and ev.resume_token != token
        token = ev.resume_token
        await echoes(c2)

    try:
        await until_relayed(server, "websocket", drop_and_resume, "resumes")
        # The spent token is refused everywhere (single use holds across workers).
        assert token is not None
        for _ in range(4):
            c3 = await LiveClient.connect(server.url, api_key=API_KEY)
            try:
                ev = await c3.resume(st.resume_token or "")
                assert isinstance(ev, wire.Error) and ev.error.code == "resume_token_used", ev
            finally:
                await c3.close()
    finally:
        for x in clients:
            await x.close()


async def test_webrtc_resume_offer_reaches_the_owner(server: ServerProcess) -> None:
    """A Live WebRTC offer with ``resume_token`` goes to the worker holding the session (an HTTP relay)."""
    # A resume offer for a token whose session is gone must be refused by the owner as resume_token_invalid, not
    # answered by a worker that never knew it: made-up tokens of each worker.
    caller = WebRTCCaller()
    try:
        sdp = await caller.offer()
        for w in (0, 1):
            offer = {"resume_token": f"w{w}.not-issued", "transport": {"type": "webrtc", "sdp": sdp}}
            for _ in range(4):
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(server.url + "/v1/live/sessions", json=offer, headers=AUTH) as r,
                ):
                    body = await r.json()
                    assert r.status == 400 and body["error"]["code"] == "resume_token_invalid", body
        # A real token (of a WebSocket session) offered over WebRTC: only its owner knows it, and says it
        # resumes a WebSocket session; a worker answering without relaying would call it invalid.
        c, st = await started(server)
        try:
            offer = {"resume_token": st.resume_token, "transport": {"type": "webrtc", "sdp": sdp}}

            async def probe() -> None:
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(server.url + "/v1/live/sessions", json=offer, headers=AUTH) as r,
                ):
                    body = await r.json()
                    assert r.status == 400 and body["error"]["code"] == "resume_transport_mismatch", body

            await until_relayed(server, "http", probe, "resume offers")
            await echoes(c)  # the probe spent nothing
        finally:
            await c.close()
    finally:
        await caller.close()


async def test_a_webrtc_call_cut_by_an_ice_failure_resumes_through_the_other_worker(
    server: ServerProcess,
) -> None:
    """A WebRTC call whose network dies detaches on its worker (ICE consent lost); the resume offer, sent on a
    connection the *other* worker accepted (its /health says which), is relayed to the owner and the same
    engine session goes on over the new peer."""
    first = WebRTCCaller(loop=False)
    second = WebRTCCaller(np.concatenate([np.zeros(24000, np.int16), tone48k(1.0)]), loop=False)
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                server.url + "/v1/live/sessions",
                json={"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": await first.offer()}},
                headers=AUTH,
            ) as r,
        ):
            body = await r.json()
            assert r.status == 200, body
        sid = body["session"]["id"]
        owner = owner_of(sid)
        await first.accept(body["transport"]["sdp"])
        await asyncio.wait_for(first.opened.wait(), 10)
        token = (await channel_event(first, "session.started"))["resume_token"]
        assert isinstance(token, str) and token
        detached = await metric_sum(server, "livekit_omni_sessions_detached_total")
        cut_network(first)
        deadline = time.monotonic() + 60  # consent expires after about 30 s of silence
        while await metric_sum(server, "livekit_omni_sessions_detached_total") <= detached:
            assert time.monotonic() < deadline, "the ICE failure never detached the session"
            await asyncio.sleep(0.5)

        before = await relayed(server, "http")
        resume = {"resume_token": token, "transport": {"type": "webrtc", "sdp": await second.offer()}}
        for _ in range(ATTEMPTS):
            # One connection for both requests: the resume goes to the worker that answered the /health.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
                async with http.get(server.url + "/health", headers=AUTH) as r:
                    if (await r.json())["worker"]["index"] == owner:
                        continue
                async with http.post(server.url + "/v1/live/sessions", json=resume, headers=AUTH) as r:
                    body = await r.json()
                    assert r.status == 200, body
            break
        else:
            raise AssertionError(f"{ATTEMPTS} connections all landed on the owner, worker {owner}")
        assert await relayed(server, "http") > before, "the resume offer was not relayed to the owner"
        assert body["session"]["id"] == sid
        await second.accept(body["transport"]["sdp"])
        await asyncio.wait_for(second.opened.wait(), 10)
        again = await channel_event(second, "session.started")
        assert again["session"]["id"] == sid and again["resume_token"] not in (None, token)
        deadline = time.monotonic() + 15
        while energy(second.received_audio()) < 0.5 * energy(tone48k(1.0)):
            assert time.monotonic() < deadline, "no echo on the new peer after the resume"
            await asyncio.sleep(0.2)
    finally:
        await first.close()
        await second.close()


async def test_realtime_call_hangup_and_sideband_work_from_either_worker(server: ServerProcess) -> None:
    sdk = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    async with call(server, key=API_KEY) as (_caller, events, headers):
        call_id = headers["Location"].rsplit("/", 1)[1]
        assert owner_of(call_id) in (0, 1)
        await events.of_type("session.created", 10)
        n = 0

        async def sideband() -> None:
            nonlocal n
            n += 1
            instructions = f"instructions #{n}"
            async with sdk.realtime.connect(call_id=call_id) as sb:
                await sb.session.update(session={"type": "realtime", "instructions": instructions})
                # A sideband carries all of the call's events, so the caller's own turn (its speech started, the
                # answer's audio) may come before the update's answer: read on to it.
                async with asyncio.timeout(10):
                    seen = await sb.recv()
                    while seen.type != "session.updated":
                        seen = await sb.recv()
                assert seen.session.instructions == instructions  # type: ignore[union-attr]
            on_channel = await events.of_type("session.updated", 10, event_id=seen.event_id)
            assert on_channel["session"]["instructions"] == instructions

        await until_relayed(server, "websocket", sideband, "sidebands")

    async def call_and_hang_up() -> None:
        async with call(server, key=API_KEY) as (caller, events, headers):
            call_id = headers["Location"].rsplit("/", 1)[1]
            await events.of_type("session.created", 10)
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{server.url}/v1/realtime/calls/{call_id}/hangup", headers=AUTH) as r,
            ):
                assert r.status == 200, await r.text()
            await wait_for_state(caller, "closed", 10)

    await until_relayed(server, "http", call_and_hang_up, "hangups")


async def test_an_ephemeral_key_works_once_whichever_worker_gets_the_offer(server: ServerProcess) -> None:
    async def mint() -> str:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                server.url + "/v1/realtime/client_secrets",
                json={
                    "expires_after": {"anchor": "created_at", "seconds": 60},
                    "session": {"instructions": "Hi."},
                },
                headers=AUTH,
            ) as r,
        ):
            assert r.status == 200, await r.text()
            return str((await r.json())["value"])

    spent: list[str] = []

    async def mint_and_spend() -> None:
        key = await mint()
        async with call(server, key=key) as (_, events, _headers):
            created = await events.of_type("session.created", 10)
            assert created["session"]["instructions"] == "Hi."
        spent.append(key)

    await until_relayed(server, "http", mint_and_spend, "ephemeral-key offers")
    caller = WebRTCCaller(None, loop=False)
    try:
        sdp = await caller.offer()
        for _ in range(4):  # spent on whichever worker the retry reaches
            status, _, body = await post_offer(server, sdp, key=spent[-1])
            assert status == 401, body
    finally:
        await caller.close()


def worker_pids(srv: ServerProcess) -> dict[int, int]:
    """Worker index -> pid, from the parent's children."""
    out: dict[int, int] = {}
    for child in psutil.Process(srv.proc.pid).children():
        cmd = child.cmdline()
        if "livekit_omni.workers" in cmd:
            out[int(cmd[cmd.index("--index") + 1])] = child.pid
    return out


async def test_a_killed_worker_is_restarted_and_the_other_keeps_its_sessions(server: ServerProcess) -> None:
    sessions = await on_both_workers(server, 2)
    victim = owner_of(sessions[0][1].session.id)
    assert victim is not None
    pids = worker_pids(server)
    assert set(pids) == {0, 1}
    psutil.Process(pids[victim]).kill()
    try:
        for c, st in sessions:
            if owner_of(st.session.id) == victim:
                await asyncio.wait_for(c.closed.wait(), 10)  # its worker died with it
            else:
                await echoes(c)
        deadline = time.monotonic() + 30
        while (new := worker_pids(server).get(victim)) in (None, pids[victim]):
            assert time.monotonic() < deadline, server.log_tail()
            await asyncio.sleep(0.2)
        for c, st in sessions:
            if owner_of(st.session.id) != victim:
                await echoes(c)  # still the same session on the survivor
        assert psutil.Process(new).is_running()
    finally:
        for c, _ in sessions:
            await c.close()
    # The new worker takes sessions again, once its engine connection is up.
    ready_line = f"[worker {victim}] livekit_omni.supervisor: engine ready"
    deadline = time.monotonic() + 30
    while server.log_path.read_text(errors="replace").count(ready_line) < 2:
        assert time.monotonic() < deadline, server.log_tail()
        await asyncio.sleep(0.2)
    fresh = await on_both_workers(server, 2)
    for c, _ in fresh:
        await echoes(c)
        await c.close()


async def test_the_parent_restarts_a_dead_engine_and_every_worker_reattaches(server: ServerProcess) -> None:
    sessions = await on_both_workers(server, 2)
    old_engine = server.engine_pid()
    psutil.Process(old_engine).kill()
    try:
        for c, _ in sessions:
            err = await c.next_event(wire.Error, timeout=10)
            assert err.error.code == "engine_lost", err
    finally:
        for c, _ in sessions:
            await c.close()
    # Both workers are back on one new engine: several answers in a row (from either worker) are 200.
    deadline = time.monotonic() + 60
    ok: set[int] = set()
    while len(ok) < 2:
        assert time.monotonic() < deadline, server.log_tail()
        code, body = await asyncio.to_thread(server.health)
        if code == 200 and body["engine"]["pid"] != old_engine and body["engine"]["restarts"] >= 1:
            ok.add(body["worker"]["index"])
        else:
            await asyncio.sleep(0.2)
    assert (
        len(
            {
                p.pid
                for p in psutil.Process(server.proc.pid).children()
                if "engine_bridge.engine" in p.cmdline()
            }
        )
        == 1
    )
    fresh = await on_both_workers(server, 2)
    for c, _ in fresh:
        await echoes(c)
        await c.close()


async def test_sigterm_drains_every_worker_then_exits_0(server: ServerProcess) -> None:
    """Last in the module: it stops the server."""
    sessions = await on_both_workers(server, 2)
    pids = worker_pids(server)
    try:
        server.proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        while (await asyncio.to_thread(server.health))[0] != 503:
            assert time.monotonic() - t_term < 3, "no worker began draining"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the parent signals the workers one after another, within microseconds
        for _ in range(4):  # whichever worker answers, it is draining
            code, body = await asyncio.to_thread(server.health)
            assert code == 503 and body.get("status") == "draining", body
        for c, _ in sessions:
            await echoes(c)  # open sessions go on during the grace, on both workers
        for c, _ in sessions:
            err = await c.next_event(wire.Error, timeout=DRAIN_GRACE_S + 5)
            assert err.error.code == "server_shutdown", err
            assert await c.wait_closed() == 1012
        assert time.monotonic() - t_term >= DRAIN_GRACE_S - 0.5
        rc = await asyncio.to_thread(server.proc.wait, 20)
        assert rc == 0, server.log_tail()
        assert not any(psutil.pid_exists(p) for p in pids.values()), "a worker outlived the parent"
    finally:
        for c, _ in sessions:
            await c.close()
