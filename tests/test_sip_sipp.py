"""The SIP endpoint against SIPp (Debian's ``sip-tester``) and raw UDP, on a real ``livekit-omni serve`` whose engine
runs the loopback echo fixture (no models: signalling, RTP and the session lifecycle need none).

The scenarios are ``tests/sip/*.xml``. What each test proves: OPTIONS is answered with our Allow list; a call is
INVITE → 100/180/200 with an SDP answer → ACK → BYE, and the caller's BYE closes the engine session at once; the
call's RTP comes paced at 20 ms, PCMU, from the port the SDP answer names, to where the caller's RTP comes from,
and carries the engine's audio (the fixture echoes the caller); CANCEL before the answer gets 200 and 487 and leaves
no session; a call over the engine's session limit gets 503 with Retry-After; a session that ends on the server's
side (its lifetime) sends the BYE; malformed requests are answered 4xx or ignored and the server keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Iterator

import numpy as np
import pytest

from media.codecs import ulaw_decode, ulaw_encode
from tests.conftest import ServerProcess, start_server
from tests.sip_peers import SCENARIOS, SippResult, free_udp_port, require, run_sipp, sip_env

pytestmark = pytest.mark.slow


def active_sessions(server: ServerProcess) -> int:
    return int(server.health()[1]["engine"]["active_sessions"])


def held_call(port: int, *, pause_ms: int) -> concurrent.futures.Future[SippResult]:
    """A SIPp call (``uac_call``) to the endpoint on ``port``, held ``pause_ms`` before its BYE, run on a thread of
    its own while the test goes on; the future holds its result."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sipp-held-call")
    try:
        return pool.submit(run_sipp, "uac_call", f"127.0.0.1:{port}", pause_ms=pause_ms)
    finally:
        pool.shutdown(wait=False)


def wait_sessions(server: ServerProcess, n: int, timeout: float = 5.0) -> float:
    """Seconds until the engine holds ``n`` sessions (fails after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if active_sessions(server) == n:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the engine holds {active_sessions(server)} sessions, not {n}, after {timeout} s")


@pytest.fixture(scope="module")
def sip_server() -> Iterator[tuple[ServerProcess, int]]:
    require("sipp")
    port = free_udp_port()
    s = start_server(adapter="loopback", env={**sip_env(port), "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "1"})
    yield s, port
    s.stop()


def test_options_is_answered_with_allow(sip_server: tuple[ServerProcess, int]) -> None:
    _server, port = sip_server
    r = run_sipp("uac_options", f"127.0.0.1:{port}")
    assert r.ok, r.out


def test_call_invite_ack_bye_closes_the_engine_session(sip_server: tuple[ServerProcess, int]) -> None:
    server, port = sip_server
    r = run_sipp("uac_call", f"127.0.0.1:{port}", pause_ms=500)
    assert r.ok, r.out
    assert "SIP/2.0 180 Ringing" in r.messages
    answer = r.messages.split("SIP/2.0 200 OK", 1)[1]
    assert re.search(r"m=audio \d+ RTP/AVP 0 101", answer), answer
    assert "a=rtpmap:101 telephone-event/8000" in answer
    # The caller's BYE ended the engine session at once.
    assert wait_sessions(server, 0, timeout=2.0) < 1.0


def test_call_over_tcp(sip_server: tuple[ServerProcess, int]) -> None:
    server, port = sip_server
    r = run_sipp("uac_call", f"127.0.0.1:{port}", transport="t1", pause_ms=300)
    assert r.ok, r.out
    wait_sessions(server, 0)


def test_cancel_before_answer_leaves_no_session(sip_server: tuple[ServerProcess, int]) -> None:
    server, port = sip_server
    r = run_sipp("uac_cancel", f"127.0.0.1:{port}")
    assert r.ok, r.out
    assert "SIP/2.0 487" in r.messages
    wait_sessions(server, 0)


def test_over_the_session_limit_is_503_with_retry_after(sip_server: tuple[ServerProcess, int]) -> None:
    server, port = sip_server
    call = held_call(port, pause_ms=4000)
    try:
        wait_sessions(server, 1)
        r = run_sipp("uac_refused_503", f"127.0.0.1:{port}")
        assert r.ok, r.out
        assert re.search(r"Retry-After: *\d+", r.messages), r.messages
    finally:
        held = call.result(30)
    assert held.ok, held.out
    wait_sessions(server, 0)


def test_concurrent_calls_with_rtp() -> None:
    """N calls at once, each with SIPp playing a G.711 A-law recording into it (``g711a.pcap``, Debian's sip-tester
    ships it): every call is answered PCMA, every call's RTP reaches the engine (the server's count of frames in),
    and every call's output clock keeps real time (late ticks are rare)."""
    n = 8
    port = free_udp_port()
    s = start_server(adapter="loopback", env={**sip_env(port), "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": str(n)})
    try:
        r = run_sipp(
            "uac_pcap",
            f"127.0.0.1:{port}",
            calls=n,
            concurrent=n,
            rate=50,
            pause_ms=8000,
            keys={"pcap": "/usr/share/sip-tester/g711a.pcap"},
            timeout=60,
        )
        assert r.ok, r.out
        wait_sessions(s, 0)
        ended = re.findall(
            r"ended \(caller_hangup\): rtp in (\d+) frames .*?out (\d+) packets; pacer (\d+) ticks, (\d+) late",
            s.log_path.read_text(errors="replace"),
        )
        assert len(ended) == n, ended
        for frames_in, packets_out, ticks, late in (tuple(map(int, e)) for e in ended):
            assert frames_in >= 230, (
                ended
            )  # the recording is 236 packets of 20 ms (one may wait in the jitter buffer)
            assert packets_out > 350 and late <= ticks // 20, ended  # 8 s of output, under 5 % late
    finally:
        s.stop()


def _rtp(seq: int, ts: int, ssrc: int, payload: bytes, pt: int = 0) -> bytes:
    return struct.pack("!BBHII", 0x80, pt, seq & 0xFFFF, ts & 0xFFFFFFFF, ssrc) + payload


def test_rtp_is_paced_symmetric_and_carries_the_engine_audio(sip_server: tuple[ServerProcess, int]) -> None:
    """Our own RTP endpoint (a UDP socket named in SIPp's SDP) receives the call's RTP and sends a tone; the loopback
    engine echoes the caller, so the tone must come back in the RTP we receive."""
    server, port = sip_server
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    rtp_port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [
            require("sipp"),
            f"127.0.0.1:{port}",
            "-sf",
            str(SCENARIOS / "uac_call.xml"),
            "-m",
            "1",
            "-i",
            "127.0.0.1",
            "-p",
            str(free_udp_port()),
            "-s",
            "omni",
            "-nostdin",
            "-d",
            "4000",
            "-key",
            "rtpport",
            str(rtp_port),
            "-timeout",
            "30s",
            "-timeout_error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    packets: list[tuple[float, bytes]] = []
    source: tuple[str, int] | None = None
    t = np.arange(160 * 50) / 8000
    tone = ulaw_encode((np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16))
    sent = 0
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                data, addr = sock.recvfrom(2048)
            except TimeoutError:
                continue
            packets.append((time.monotonic(), data))
            source = addr
            if len(packets) >= 10 and sent < 50:
                # Symmetric RTP: our tone goes to where the server's RTP comes from.
                sock.sendto(
                    _rtp(1000 + sent, 160 * sent, 0x1234, tone[160 * sent : 160 * (sent + 1)].tobytes()), addr
                )
                sent += 1
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert source is not None and len(packets) > 100, len(packets)
    heads = [struct.unpack("!BBHII", d[:12]) for _, d in packets]
    assert {h[1] & 0x7F for h in heads} == {0}, "PCMU"
    assert len({h[4] for h in heads}) == 1, "one SSRC"
    seqs = [h[2] for h in heads]
    assert all((b - a) & 0xFFFF == 1 for a, b in itertools.pairwise(seqs)), "consecutive sequence numbers"
    tss = [h[3] for h in heads]
    assert all((b - a) & 0xFFFFFFFF == 160 for a, b in itertools.pairwise(tss)), "20 ms timestamps"
    arrivals = np.diff([t for t, _ in packets])
    assert 0.015 < float(np.median(arrivals)) < 0.025, float(np.median(arrivals))
    span = packets[-1][0] - packets[0][0]
    assert abs(len(packets) / span - 50) < 5, len(packets) / span
    pcm = ulaw_decode(b"".join(d[12:] for _, d in packets))
    levels = np.sqrt((pcm[: pcm.shape[0] // 160 * 160].astype(np.float64).reshape(-1, 160) ** 2).mean(axis=1))
    assert (levels[:8] < 50).all(), "silence before the caller spoke"
    assert (levels > 2000).sum() >= 30, f"the echoed tone: {np.round(levels).astype(int).tolist()}"
    wait_sessions(server, 0)


MALFORMED: list[bytes] = [
    b"",
    b"\r\n\r\n",
    b"\x00\xff" * 40,
    b"INVITE\r\n\r\n",
    b"INVITE sip:omni@127.0.0.1 SIP/2.0\r\n\r\n",
    b"OPTIONS sip:omni@127.0.0.1 SIP/2.0\r\nCall-ID: x\r\nCSeq: 1 OPTIONS\r\n\r\n",
    b"FOO sip:omni@127.0.0.1 SIP/2.0\r\n" + b"Via: SIP/2.0/UDP 127.0.0.1:{p};branch=z9hG4bKfoo\r\n"
    b"From: <sip:a@b>;tag=1\r\nTo: <sip:omni@127.0.0.1>\r\nCall-ID: m1\r\nCSeq: 1 FOO\r\n\r\n",
    b"SIP/2.0 200 OK\r\nVia: SIP/2.0/UDP 127.0.0.1:{p};branch=z9hG4bKnope\r\nCSeq: 1 BYE\r\nCall-ID: m2\r\n\r\n",
]


def _invite(p: int, n: int, *, headers: str = "", body: str = "", ctype: str = "application/sdp") -> bytes:
    base = (
        f"INVITE sip:omni@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{p};branch=z9hG4bKmal{n}\r\n"
        f"From: <sip:fuzz@127.0.0.1>;tag=f{n}\r\nTo: <sip:omni@127.0.0.1>\r\nCall-ID: mal-{n}\r\nCSeq: 1 INVITE\r\n"
        f"Max-Forwards: 70\r\n{headers}"
    )
    if body:
        base += f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
    return (base + "\r\n" + body).encode()


def test_malformed_requests_are_refused_or_ignored(sip_server: tuple[ServerProcess, int]) -> None:
    server, port = sip_server
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.3)
    me = sock.getsockname()[1]
    requests = [m.replace(b"{p}", str(me).encode()) for m in MALFORMED]
    requests += [
        _invite(me, 1, body="v=0\r\nthis is not sdp\r\n"),
        _invite(me, 2, body="v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"),
        _invite(
            me,
            3,
            body="v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            "m=audio 4000 RTP/AVP 3\r\na=rtpmap:3 GSM/8000\r\n",
        ),
        _invite(
            me,
            4,
            body="v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            "m=audio 4000 RTP/SAVP 0\r\n",
        ),
        _invite(me, 5).replace(b";tag=f5", b""),
        _invite(me, 6).replace(b"CSeq: 1 INVITE", b"CSeq: 1 BYE"),
        _invite(me, 7).replace(b"CSeq: 1 INVITE", b"CSeq: x INVITE"),
        _invite(me, 8, headers="X-Junk: " + "A" * 30000 + "\r\n"),
        _invite(me, 9, headers="".join(f"X-H{i}: {i}\r\n" for i in range(300))),
        _invite(me, 10)
        .replace(b"Content-Length", b"Content-Length: -5\r\nX")
        .replace(b"\r\n\r\n", b"\r\nContent-Length: -5\r\n\r\n"),
        _invite(me, 11, body="\xff\xfe garbage", ctype="application/sdp"),
        b"BYE sip:omni@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:"
        + str(me).encode()
        + b";branch=z9hG4bKbye\r\nFrom: <sip:a@b>;tag=1\r\nTo: <sip:omni@127.0.0.1>;tag=2\r\nCall-ID: nope\r\n"
        b"CSeq: 2 BYE\r\n\r\n",
    ]
    assert len(requests) >= 20
    statuses: list[int | None] = []
    for req in requests:
        sock.sendto(req, ("127.0.0.1", port))
        got: int | None = None
        try:
            while True:
                data, _ = sock.recvfrom(65535)
                m = re.match(rb"SIP/2\.0 (\d{3})", data)
                if m and int(m.group(1)) >= 200:
                    got = int(m.group(1))
                    break
        except TimeoutError:
            pass
        statuses.append(got)
    sock.close()
    for req, status in zip(requests, statuses, strict=True):
        assert status is None or 400 <= status < 500, (status, req[:120])
    assert sum(s is not None for s in statuses) >= 10, statuses
    # The server goes on serving: OPTIONS and a call.
    assert run_sipp("uac_options", f"127.0.0.1:{port}").ok
    r = run_sipp("uac_call", f"127.0.0.1:{port}", pause_ms=200)
    assert r.ok, r.out
    assert server.proc.poll() is None
    body = server.health()[1]
    assert body["sip"]["transports"]["OmniUdpTransport"]["malformed"] >= 3, json.dumps(body["sip"])
    wait_sessions(server, 0)


def test_reinvite_hold_and_resume(sip_server: tuple[ServerProcess, int]) -> None:
    """A re-INVITE with ``a=sendonly`` holds the call (we answer ``recvonly`` and stop sending), one with
    ``a=sendrecv`` resumes it; both on the call's RTP port."""
    server, port = sip_server
    r = run_sipp("uac_hold", f"127.0.0.1:{port}", pause_ms=300)
    assert r.ok, r.out
    answers = [m.split("\r\n\r\n", 1)[-1] for m in r.messages.split("SIP/2.0 200 OK")[1:]]
    ports = {re.search(r"m=audio (\d+)", a).group(1) for a in answers if "m=audio" in a}  # type: ignore[union-attr]
    assert len(ports) == 1, ports
    assert "on hold" in server.log_tail(200) and "resumed" in server.log_tail(200)
    wait_sessions(server, 0)


@pytest.fixture(scope="module")
def policy_server() -> Iterator[tuple[ServerProcess, int]]:
    """Digest credentials, the loopback network allowed, session timers on (the default)."""
    port = free_udp_port()
    env = sip_env(
        port,
        credentials=json.dumps([{"username": "alice", "password": "s3cret"}]),
        allowed_sources=json.dumps(["127.0.0.0/8"]),
    )
    s = start_server(adapter="loopback", env=env)
    yield s, port
    s.stop()


def test_digest_auth_challenges_then_admits(policy_server: tuple[ServerProcess, int]) -> None:
    server, port = policy_server
    r = run_sipp("uac_auth", f"127.0.0.1:{port}", extra_args=["-au", "alice", "-ap", "s3cret"], pause_ms=200)
    assert r.ok, r.out
    assert "SIP/2.0 401" in r.messages and re.search(r"^Authorization: Digest", r.messages, re.M)
    wait_sessions(server, 0)


def test_digest_auth_refuses_a_wrong_password(policy_server: tuple[ServerProcess, int]) -> None:
    server, port = policy_server
    r = run_sipp("uac_auth_refused", f"127.0.0.1:{port}", extra_args=["-au", "alice", "-ap", "wrong"])
    assert r.ok, r.out
    assert active_sessions(server) == 0
    # Without credentials, a plain call is refused too (401).
    r = run_sipp("uac_call", f"127.0.0.1:{port}")
    assert not r.ok and "SIP/2.0 401" in r.messages


def test_session_timers(sip_server: tuple[ServerProcess, int]) -> None:
    """RFC 4028: an interval under our Min-SE gets 422 with Min-SE; an offered one is echoed, refresher and all."""
    server, port = sip_server
    r = run_sipp("uac_timer", f"127.0.0.1:{port}", pause_ms=200)
    assert r.ok, r.out
    assert "SIP/2.0 422" in r.messages and re.search(r"^Min-SE: 90", r.messages, re.M | re.I), r.messages
    wait_sessions(server, 0)


def test_sources_outside_allowed_sources_get_403() -> None:
    port = free_udp_port()
    s = start_server(adapter="loopback", env=sip_env(port, allowed_sources=json.dumps(["10.0.0.0/8"])))
    try:
        r = run_sipp("uac_options", f"127.0.0.1:{port}")
        assert not r.ok and "SIP/2.0 403" in r.messages, r.messages
        r = run_sipp("uac_call", f"127.0.0.1:{port}")
        assert not r.ok and "SIP/2.0 403" in r.messages
        assert active_sessions(s) == 0
    finally:
        s.stop()


def test_the_server_ends_a_call_with_bye() -> None:
    """A session that ends on the server's side (here its lifetime) hangs the call up: the caller gets our BYE."""
    port = free_udp_port()
    s = start_server(
        adapter="loopback", env={**sip_env(port), "LIVEKIT_OMNI_LIMITS__SESSION_LIFETIME_S": "2"}
    )
    try:
        r = run_sipp("uac_server_bye", f"127.0.0.1:{port}", timeout=30)
        assert r.ok, r.out
        assert re.search(r"^BYE sip:", r.messages, re.M), r.messages
        wait_sessions(s, 0)
    finally:
        s.stop()


def _options_status(port: int) -> int | None:
    """The status of a raw OPTIONS to the endpoint (None: no answer in 2 s)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(2)
        me = sock.getsockname()[1]
        sock.sendto(
            (
                f"OPTIONS sip:omni@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{me};branch=z9hG4bKdrain{time.time_ns()}\r\n"
                f"From: <sip:probe@127.0.0.1>;tag=p\r\nTo: <sip:omni@127.0.0.1>\r\nCall-ID: drain-{time.time_ns()}\r\n"
                "CSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n"
            ).encode(),
            ("127.0.0.1", port),
        )
        try:
            data, _ = sock.recvfrom(65535)
        except TimeoutError:
            return None
    m = re.match(rb"SIP/2\.0 (\d{3})", data)
    return int(m.group(1)) if m else None


def test_a_draining_node_refuses_new_calls_and_keeps_its_call() -> None:
    """SIGTERM drains: OPTIONS and new INVITEs get 503 with Retry-After (a proxy takes the node out of rotation and
    fails over), while the call in progress goes on to its own BYE."""
    port = free_udp_port()
    s = start_server(adapter="loopback", env={**sip_env(port), "LIVEKIT_OMNI_DRAIN_GRACE_S": "30"})
    try:
        assert _options_status(port) == 200
        call = held_call(port, pause_ms=4000)
        wait_sessions(s, 1)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while _options_status(port) != 503:
            assert time.monotonic() < deadline, "OPTIONS is not 503 while draining"
        r = run_sipp("uac_refused_503", f"127.0.0.1:{port}")
        assert r.ok, r.out
        held = call.result(30)
        assert held.ok, held.out  # the call in progress ended with its BYE
        assert s.proc.wait(30) == 0  # the drain ends once its last call has
    finally:
        s.stop()


def test_a_call_being_answered_when_the_drain_begins_is_kept() -> None:
    """A SIGTERM that lands while a call's engine session is still opening (the engine is held with SIGSTOP to
    make that window wide) must not shut the server down under the call: the drain waits for it like any open
    call, the call is answered and goes on to its own BYE, and the server then exits 0."""
    port = free_udp_port()
    s = start_server(adapter="loopback", env={**sip_env(port), "LIVEKIT_OMNI_DRAIN_GRACE_S": "30"})
    engine_pid = s.engine_pid()
    try:
        os.kill(engine_pid, signal.SIGSTOP)
        call = held_call(port, pause_ms=2000)
        deadline = time.monotonic() + 10
        while s.health()[1].get("sip", {}).get("calls") != 1:  # the INVITE is in; its engine session waits
            assert time.monotonic() < deadline, "the INVITE never reached the server"
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the drain has begun with no session open yet
        os.kill(engine_pid, signal.SIGCONT)
        held = call.result(30)
        assert held.ok, held.out  # answered, then ended by its own BYE
        assert s.proc.wait(30) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGCONT)
        s.stop()


def test_reinvite_changes_the_codec(sip_server: tuple[ServerProcess, int]) -> None:
    """A re-INVITE offering only PCMA switches a PCMU call's RTP to PCMA (payload type 8), on the same port."""
    server, port = sip_server
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    proc = subprocess.Popen(
        [
            require("sipp"),
            f"127.0.0.1:{port}",
            "-sf",
            str(SCENARIOS / "uac_codec_change.xml"),
            "-m",
            "1",
            "-i",
            "127.0.0.1",
            "-p",
            str(free_udp_port()),
            "-s",
            "omni",
            "-nostdin",
            "-d",
            "1500",
            "-key",
            "rtpport",
            str(sock.getsockname()[1]),
            "-timeout",
            "30s",
            "-timeout_error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    types: list[int] = []
    sources: set[tuple[str, int]] = set()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                data, addr = sock.recvfrom(2048)
            except TimeoutError:
                continue
            types.append(data[1] & 0x7F)
            sources.add(addr)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close()
    assert types and types[0] == 0 and types[-1] == 8, types[:5] + types[-5:]
    switches = sum(1 for a, b in itertools.pairwise(types) if a != b)
    assert switches == 1, "PCMU, then PCMA from the re-INVITE on"
    assert len(sources) == 1, "the same RTP port"
    wait_sessions(server, 0)


def test_a_call_set_up_over_tcp_can_be_ended_over_udp(sip_server: tuple[ServerProcess, int]) -> None:
    """One table of dialogs for every transport: INVITE over TCP, then ACK and BYE over UDP (what a UA does when the
    Contact names no transport) end the call."""
    server, port = sip_server
    sdp = (
        "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
        "m=audio 4000 RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n"
    )
    tcp = socket.create_connection(("127.0.0.1", port), timeout=5)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(3)
    me = tcp.getsockname()[1]
    head = (
        f"INVITE sip:omni@127.0.0.1:{port} SIP/2.0\r\nVia: SIP/2.0/TCP 127.0.0.1:{me};branch=z9hG4bKtcp1\r\n"
        "From: <sip:t@127.0.0.1>;tag=tt\r\nTo: <sip:omni@127.0.0.1>\r\nCall-ID: tcp-udp-1\r\nCSeq: 1 INVITE\r\n"
        f"Contact: <sip:t@127.0.0.1:{udp.getsockname()[1]}>\r\nMax-Forwards: 70\r\nContent-Type: application/sdp\r\n"
        f"Content-Length: {len(sdp)}\r\n\r\n{sdp}"
    )
    try:
        tcp.sendall(head.encode())
        buf = b""
        while b"SIP/2.0 200" not in buf:
            chunk = tcp.recv(65535)
            assert chunk, buf
            buf += chunk
        ok = buf[buf.index(b"SIP/2.0 200") :].decode(errors="replace")
        to = next(line for line in ok.split("\r\n") if line.lower().startswith("to:"))
        wait_sessions(server, 1)
        u = udp.getsockname()[1]
        for method, cseq, branch in (("ACK", 1, "z9hG4bKack1"), ("BYE", 2, "z9hG4bKbye1")):
            udp.sendto(
                (
                    f"{method} sip:omni@127.0.0.1:{port} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{u};branch={branch}\r\n"
                    f"From: <sip:t@127.0.0.1>;tag=tt\r\n{to}\r\nCall-ID: tcp-udp-1\r\nCSeq: {cseq} {method}\r\n"
                    "Max-Forwards: 70\r\nContent-Length: 0\r\n\r\n"
                ).encode(),
                ("127.0.0.1", port),
            )
        data, _ = udp.recvfrom(65535)
        assert data.startswith(b"SIP/2.0 200") and b"CSeq: 2 BYE" in data, data[:200]
        wait_sessions(server, 0)
    finally:
        tcp.close()
        udp.close()
