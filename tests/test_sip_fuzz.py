"""The SIP edge under 10,000 mutated requests: aiosipua's parser and dialogs behind our hardened transport
(``livekit_omni/sip/transport.py``, whose transaction key is the one piece of SIP we parse ourselves) and our UAS
checks (``livekit_omni/sip/uas.py``), on a real UDP socket in this process.

Every request is answered 4xx (or 2xx/1xx where it is valid after all, or 486 for an INVITE: this UAS refuses every
call), or not at all; none is answered 5xx (an exception inside a handler), nothing escapes to the event loop, and
the endpoint still answers OPTIONS afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket

import pytest
from aiosipua.incoming_call import IncomingCall
from aiosipua.message import SipMessage

from livekit_omni.sip.transport import OmniUdpTransport, ResponseCache, transaction_key
from livekit_omni.sip.uas import OmniUAS

SDP = (
    "v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 4000 RTP/AVP 0 8 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\na=sendrecv\r\n"
)


def seeds(port: int) -> list[bytes]:
    def req(method: str, n: int, body: str = "", extra: str = "") -> bytes:
        head = (
            f"{method} sip:omni@127.0.0.1:5060 SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK{n};rport\r\n"
            f'Max-Forwards: 70\r\nFrom: "F" <sip:f@127.0.0.1>;tag=t{n}\r\nTo: <sip:omni@127.0.0.1>{extra}\r\n'
            f"Call-ID: fz{n}@127.0.0.1\r\nCSeq: {n} {method}\r\nContact: <sip:f@127.0.0.1:{port}>\r\n"
        )
        if body:
            head += f"Content-Type: application/sdp\r\nContent-Length: {len(body)}\r\n"
        else:
            head += "Content-Length: 0\r\n"
        return (head + "\r\n" + body).encode()

    return [
        req("INVITE", 1, SDP),
        req("OPTIONS", 2),
        req("BYE", 3, extra=";tag=x"),
        req("CANCEL", 4),
        req("ACK", 5, extra=";tag=x"),
        req("UPDATE", 6, SDP, extra=";tag=x"),
        req("REFER", 7, extra=";tag=x"),
        req("REGISTER", 8),
    ]


def mutate(rng: random.Random, raw: bytes) -> bytes:
    b = bytearray(raw)
    k = rng.randrange(8)
    if k == 0:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif k == 1:
        b = b[: rng.randrange(len(b))]
    elif k == 2:
        lines = bytes(b).split(b"\r\n")
        rng.shuffle(lines)
        b = bytearray(b"\r\n".join(lines))
    elif k == 3:
        lines = bytes(b).split(b"\r\n")
        del lines[rng.randrange(len(lines))]
        b = bytearray(b"\r\n".join(lines))
    elif k == 4:
        i = rng.randrange(len(b))
        b[i:i] = rng.choice(
            [
                b"\x00",
                b"\r\n",
                b":",
                b";",
                b"<",
                b">",
                b'"',
                b"%",
                b"=" * 300,
                b"\xff\xfe",
                b" " * 2000,
                b",,,",
            ]
        )
    elif k == 5:
        old = rng.choice([b"CSeq: ", b"Content-Length: ", b"branch=", b"tag=", b"m=audio ", b"SIP/2.0"])
        new = rng.choice([b"", b"-1 ", b"99999999999 ", b"x", b"\t", b"SIP/3.0"])
        b = bytearray(bytes(b).replace(old, old + new, 1))
    elif k == 6:
        lines = bytes(b).split(b"\r\n")
        i = rng.randrange(1, max(2, len(lines)))
        lines.insert(i, lines[rng.randrange(len(lines))])
        b = bytearray(b"\r\n".join(lines))
    else:
        b = bytearray(bytes(b).replace(b"\r\n", rng.choice([b"\n", b"\r", b"\r\n "]), rng.randint(1, 4)))
    return bytes(b)


def test_transaction_key_never_raises() -> None:
    rng = random.Random(7)
    keys = 0
    for _ in range(20_000):
        junk = "".join(rng.choice("SIP/2.0UDP ;=branchz9hG4bK,\t:") for _ in range(rng.randrange(40)))
        via = rng.choice(
            [junk, f"SIP/2.0/UDP h;{junk}", f"SIP/2.0/UDP h;branch={junk}", "SIP/2.0/UDP h;branch=z9"]
        )
        cseq = "".join(rng.choice("0123456789 INVITEbye\t-") for _ in range(rng.randrange(14)))
        cseq = rng.choice([cseq, f"{rng.randrange(10**6)} {cseq}", "1 INVITE"])
        msg = SipMessage()
        if rng.random() < 0.9:
            msg.headers.append("Via", via)
        if rng.random() < 0.9:
            msg.headers.append("CSeq", cseq)
        key = transaction_key(msg)
        if key is not None:
            keys += 1
            assert key[0] and key[1] >= 0 and key[2]
    assert keys > 100


def test_response_cache_is_bounded() -> None:
    cache = ResponseCache(linger_s=60, limit=100)
    for n in range(1000):
        assert cache.begin((f"b{n}", n, "INVITE")) == (False, None)
    assert len(cache) <= 101


@pytest.mark.asyncio
async def test_ten_thousand_mutated_requests(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    loop.set_exception_handler(
        lambda _loop, ctx: errors.append(ctx.get("exception") or RuntimeError(ctx["message"]))
    )
    transport = OmniUdpTransport(local_addr=("127.0.0.1", 0))
    uas = OmniUAS(transport, user_agent="fuzz")

    def refuse(call: IncomingCall) -> None:
        uas.reject(call, 486)

    uas.on_invite = refuse
    await uas.start()
    assert transport._udp_transport is not None
    server = transport._udp_transport.get_extra_info("sockname")[:2]
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    client.setblocking(False)
    me = client.getsockname()[1]
    corpus = seeds(me)
    rng = random.Random(39)
    statuses: dict[int, int] = {}
    try:
        for i in range(10_000):
            # A fresh transaction and call for each (a repeated branch would only be answered as a retransmission).
            seed = (
                rng.choice(corpus)
                .replace(b"z9hG4bK", b"z9hG4bK%dx" % i)
                .replace(b"Call-ID: fz", b"Call-ID: %dfz" % i)
            )
            client.sendto(mutate(rng, seed), server)
            await asyncio.sleep(0)  # the endpoint reads one datagram per turn of the loop
            await asyncio.sleep(0)
            if i % 50 == 49:
                while True:
                    try:
                        data = client.recv(65535)
                    except BlockingIOError:
                        break
                    m = re.match(rb"SIP/2\.0 (\d{3})", data)
                    if m:
                        code = int(m.group(1))
                        statuses[code] = statuses.get(code, 0) + 1
        await asyncio.sleep(0.2)
        # Still serving: a clean OPTIONS is answered 200.
        while True:  # what is left of the fuzz's answers
            try:
                client.recv(65535)
            except BlockingIOError:
                break
        client.sendto(corpus[1].replace(b"z9hG4bK2", b"z9hG4bKafter"), server)
        answer = b""
        for _ in range(200):
            await asyncio.sleep(0.01)  # the endpoint runs on this loop: never block it
            try:
                answer = client.recv(65535)
            except BlockingIOError:
                continue
            if answer.startswith(b"SIP/2.0 200"):
                break
        assert answer.startswith(b"SIP/2.0 200"), answer[:80]
    finally:
        client.close()
        await uas.stop()
        loop.set_exception_handler(None)
    assert not errors, errors[:3]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records[:3]
    assert not [c for c in statuses if c >= 500], statuses
    assert sum(statuses.values()) > 5000, statuses
    assert transport.hardening.malformed > 0
