"""The media plane's loss counters on /metrics (what benchmarks/soak.py reads): ring overruns, egress underruns and
dropped events, against a real ``livekit-omni serve`` (loopback echo engine) and a real stalled engine process.

A session at real time loses nothing; the same session with its engine stopped (SIGSTOP: the engine's audio thread
no longer reads) overruns the ingress ring, and the counter keeps the session's figure once it has ended.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from livekit_omni.live import wire
from testkit.live_client import LiveClient
from tests.conftest import ServerProcess, start_server

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): a stalled engine, ~11 s.
pytestmark = pytest.mark.slow

RATE = 24_000
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server(adapter="loopback", env={"LIVEKIT_OMNI_EVENT_LOG": ""})
    try:
        yield s
    finally:
        s.stop()


def scrape(server: ServerProcess) -> Scrape:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(m: Scrape, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def losses(m: Scrape) -> dict[str, float]:
    return {
        "ingress": value(m, "livekit_omni_ring_overruns_total", ring="ingress"),
        "egress": value(m, "livekit_omni_ring_overruns_total", ring="egress"),
        "underruns": value(m, "livekit_omni_egress_underruns_total"),
        "transcripts": value(m, "livekit_omni_dropped_events_total", reason="transcript_overflow"),
        "too_large": value(m, "livekit_omni_dropped_events_total", reason="too_large"),
        "unread": value(m, "livekit_omni_dropped_events_total", reason="client_not_reading"),
    }


def tone_append() -> bytes:
    t = np.arange(RATE // 10) / RATE
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype("<i2").tobytes()


async def stream(c: LiveClient, seconds: float) -> None:
    await c.append_audio(tone_append() * round(seconds * 10), bytes_per_100ms=RATE // 10 * 2)


async def test_real_time_session_loses_nothing_and_a_stalled_engine_overruns_ingress(
    server: ServerProcess,
) -> None:
    before = losses(await asyncio.to_thread(scrape, server))
    c = await LiveClient.connect(server.url, api_key=None)
    ev = await c.start({"model": "m", "audio": {"format": {"type": "audio/pcm", "rate": RATE}}})
    assert isinstance(ev, wire.SessionStarted), ev
    try:
        await stream(c, 2.0)
        during = losses(await asyncio.to_thread(scrape, server))
        assert (during["ingress"], during["egress"]) == (before["ingress"], before["egress"]), during
        assert c.audio_bytes > 0  # the echo came back: the counters describe a working session

        engine = server.engine_pid()
        os.kill(engine, signal.SIGSTOP)
        try:
            # The ingress ring holds a few seconds; real-time input (within the input budget) overflows it.
            deadline = time.monotonic() + 30
            while True:
                await stream(c, 1.0)
                stalled = losses(await asyncio.to_thread(scrape, server))
                if stalled["ingress"] > before["ingress"]:
                    break
                assert time.monotonic() < deadline, "a stalled engine never overran the ingress ring"
        finally:
            os.kill(engine, signal.SIGCONT)
    finally:
        await c.close()
    # Ended sessions keep their figures (the hub adds them up before the rings are released).
    deadline = time.monotonic() + 10
    while True:
        m = await asyncio.to_thread(scrape, server)
        after = losses(m)
        if value(m, "livekit_omni_active_sessions", transport="websocket") == 0.0:
            break
        assert time.monotonic() < deadline, "the session never ended"
        await asyncio.sleep(0.1)
    assert after["ingress"] >= stalled["ingress"] > before["ingress"]
    assert after["too_large"] == before["too_large"] and after["unread"] == before["unread"]
