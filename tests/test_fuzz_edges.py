"""Fuzzing at every edge, a few hundred inputs each, through the same generators, runners and judge as
``benchmarks/fuzz_edges.py`` (:mod:`testkit.fuzz`), against a real ``livekit-omni serve`` whose
engine runs the loopback echo *test fixture* (no models). Plus the judge's self-test, and regression tests for the
bugs the fuzzer found (each also has a unit test next to the code it fixed).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import aiohttp
import pytest

from livekit_omni.live import wire
from testkit import fuzz
from testkit.fuzz import EdgeReport, FuzzInput, FuzzTarget, LiveObservation, Outcome
from tests.conftest import ServerProcess, start_server
from tests.sip_peers import free_udp_port, sip_env

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): fuzzing runs of several seconds each.
pytestmark = pytest.mark.slow

SEED = 20
#: Inputs per edge; the benchmark runs 10,000.
INPUTS = {
    "live_json": 400,
    "base64_audio": 300,
    "control": 400,
    "sdp": 200,
    "rtp_opus": 500,
    "realtime_json": 400,
    "sip": 1000,
}
#: Outcomes that show the input was refused (the fuzzer is hostile, not a stream of valid events).
REFUSALS = (Outcome.ERROR_ALIVE, Outcome.REFUSED, Outcome.CLEAN_CLOSE, Outcome.IGNORED)
#: The SIP endpoint's UDP port (the ``sip`` edge).
SIP_PORT = free_udp_port()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_ENGINE__MAX_SESSIONS": "64",
            "LIVEKIT_OMNI_WEBRTC__LOOPBACK_ONLY": "true",
            # Offers the fuzzer never connects release their engine slot after this (the default is 30 s).
            "LIVEKIT_OMNI_LIMITS__WEBRTC_CONNECT_TIMEOUT_S": "2",
            **sip_env(SIP_PORT),
        },
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def target(server: ServerProcess) -> FuzzTarget:
    return FuzzTarget(server.url, server.proc.pid, "unix:" + server.socket_path, sip_port=SIP_PORT)


@pytest.mark.parametrize("edge", fuzz.EDGES)
async def test_edge_survives_its_fuzz(target: FuzzTarget, edge: str) -> None:
    n = INPUTS[edge]
    report = await fuzz.fuzz_edge(target, edge, seed=SEED, inputs=n)
    print(report.table())
    assert report.inputs == n
    assert report.engine_deaths == 0
    assert report.unexpected_closes == 0, report.examples
    assert report.bad == 0, report.examples
    assert report.rss_growth_mb < 60, report.rss_growth_mb
    assert report.fd_growth < 20, report.fd_growth  # peers and sessions that were refused or ended are freed
    if edge == "rtp_opus":
        # No per-packet answer on RTP: every batch was followed by a working call (echo heard, data channel alive),
        # empty payloads included.
        assert report.count(Outcome.ACCEPTED) == n and "empty" in report.outcomes
    else:
        refused = sum(report.count(o) for o in REFUSALS)
        assert refused > n // 2, report.summary()


def test_inputs_are_reproducible_from_the_seed() -> None:
    for edge, gen in fuzz.GENERATORS.items():

        def draw(seed: int, gen: fuzz.InputsFn = gen, edge: str = edge) -> list[str]:
            return [repr(i.data) for i in gen(random.Random(fuzz.edge_seed(seed, edge)), 50)]

        assert draw(5) == draw(5), edge
        assert draw(5) != draw(6), edge


def test_judge_counts_a_close_without_an_error_and_a_close_where_the_session_should_live() -> None:
    err = wire.error_event("invalid_json", "bad")
    closed = wire.SessionClosed(
        reason="close_requested",
        session=wire.session_resource(
            wire.resolve_config(wire.StartConfig(model="m")), session_id="live_x", expires_at=0
        ),
        usage=wire.usage(1.0),
    )
    # The bug this edge was built for: deep nesting closed the session with 1000 and no error event.
    assert fuzz.judge_live(LiveObservation([], closed=True, close_code=1000)) is Outcome.UNEXPECTED_CLOSE
    # An error first, but the protocol lets a malformed event leave the session alive.
    assert fuzz.judge_live(LiveObservation([err], closed=True, close_code=1008)) is Outcome.UNEXPECTED_CLOSE
    # A refused session.start may close (error first, documented code); a 1006 may not.
    assert fuzz.judge_live(LiveObservation([err], True, 1008, may_close=True)) is Outcome.CLEAN_CLOSE
    assert fuzz.judge_live(LiveObservation([err], True, 1006, may_close=True)) is Outcome.UNEXPECTED_CLOSE
    assert fuzz.judge_live(LiveObservation([closed], True, 1000, may_close=True)) is Outcome.CLEAN_CLOSE
    assert fuzz.judge_live(LiveObservation([err], closed=False)) is Outcome.ERROR_ALIVE
    assert fuzz.judge_live(LiveObservation([], closed=False, answered=False)) is Outcome.NO_ANSWER
    untyped = wire.error_event("", "no code")
    assert fuzz.judge_live(LiveObservation([untyped], closed=False)) is Outcome.UNTYPED_ERROR
    # HTTP: a 500 and a body that is not a typed error are bugs; a typed 400/503 is a refusal.
    body = json.dumps({"error": {"type": "server_error", "code": "internal_error", "message": "x"}}).encode()
    assert fuzz.judge_http(500, body) is Outcome.INTERNAL_ERROR
    assert fuzz.judge_http(400, b"Bad Request") is Outcome.UNTYPED_ERROR
    assert fuzz.judge_http(503, body) is Outcome.REFUSED


async def test_checker_catches_a_real_unexpected_close(target: FuzzTarget) -> None:
    """Through the real runner and server: a ``session.close`` that the input claims may not end the session is
    reported as an unexpected close (the same path would report any other close the server makes)."""
    report = EdgeReport("self_test")
    close = json.dumps({"type": "session.close", "event_id": "c"})
    ok = json.dumps({"type": "session.input_audio.mute", "event_id": "m"})
    await fuzz.run_live(
        target, iter([FuzzInput("mute", ok), FuzzInput("close_not_allowed", close, may_close=False)]), report
    )
    assert report.outcomes["mute"][Outcome.ACCEPTED] == 1
    assert report.outcomes["close_not_allowed"][Outcome.UNEXPECTED_CLOSE] == 1
    assert report.unexpected_closes == 1 and report.examples


# --- regressions the fuzzer found (HTTP side; the others are unit tests next to their fixes) ------------------


def _offer_lines() -> list[str]:
    return fuzz.AIORTC_OFFER.split("\r\n")[:-1]


def _with_duplicated_audio_section() -> str:
    lines = _offer_lines()
    start = next(i for i, line in enumerate(lines) if line.startswith("m=audio"))
    end = next(i for i, line in enumerate(lines) if line.startswith("m=application"))
    return "\r\n".join(lines[:end] + lines[start:end] + lines[end:]) + "\r\n"


def _without(prefix: str) -> str:
    return "\r\n".join(line for line in _offer_lines() if not line.startswith(prefix)) + "\r\n"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        # Not UTF-8: msgspec raised UnicodeDecodeError and the server answered a bare 500.
        (b'{"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": "v=0\xfe"}}', "invalid_json"),
        # Offers aiortc accepts but cannot answer (AttributeError / ValueError inside createAnswer): were 500s.
        (_with_duplicated_audio_section(), "invalid_sdp"),
        (_without("a=sendrecv"), "invalid_sdp"),
        # No DTLS fingerprint: answered, then the connection failed in a background task nobody saw.
        (_without("a=fingerprint:"), "invalid_sdp"),
    ],
    ids=["non_utf8_body", "duplicated_audio_section", "no_direction", "no_fingerprint"],
)
async def test_bad_offers_get_a_typed_400(server: ServerProcess, body: bytes | str, code: str) -> None:
    data = (
        body
        if isinstance(body, bytes)
        else json.dumps({"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": body}}).encode()
    )
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            server.url + "/v1/live/sessions", data=data, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        text = await r.read()
        assert r.status == 400, text
        assert json.loads(text)["error"]["code"] == code


async def test_an_offer_that_never_connects_frees_its_slot_at_the_connect_deadline(
    server: ServerProcess, target: FuzzTarget
) -> None:
    await target.wait_idle()
    body = {"session": {"model": "m"}, "transport": {"type": "webrtc", "sdp": fuzz.AIORTC_OFFER}}
    async with aiohttp.ClientSession() as http, http.post(server.url + "/v1/live/sessions", json=body) as r:
        assert r.status == 200
    assert (await asyncio.to_thread(target.health))["engine"]["active_sessions"] == 1
    t0 = time.monotonic()
    await target.wait_idle(timeout=10)
    held = time.monotonic() - t0
    assert (await asyncio.to_thread(target.health))["engine"]["active_sessions"] == 0
    assert held < 5, held  # the 2 s deadline of this server, not the 30 s default
