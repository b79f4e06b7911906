"""Engine memory does not grow with sessions: RSS after 50 sessions opened, used and closed stays within 10% of
its value after the first one (real engine process, real models)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from tests.conftest import connect_engine, spawn_engine

pytestmark = pytest.mark.models


async def use_one_session(client: EngineClient, i: int) -> None:
    session = await client.open_session(p.SessionConfig(instructions=f"You are assistant number {i}."))
    await session.append_text("thinking", f"The caller's order number is {1000 + i}.")
    await session.append_text("speak_now", "")
    # Act as a media plane that drains egress as fast as it can (no real-time pacing needed to measure memory).
    out = np.zeros(1 << 16, dtype=np.int16)
    silence = np.zeros(320, dtype=np.int16)
    got = 0
    async with asyncio.timeout(60):
        while True:
            session.rings.ingress.write(silence)
            session.ring_doorbell()
            while (info := session.rings.egress.read_chunk(out)) is not None:
                got += info.nsamples
            ev = None
            while not session.events.empty():
                ev = session.events.get_nowait()
                if isinstance(ev, p.ReplyDone):
                    break
            if isinstance(ev, p.ReplyDone):
                break
            await asyncio.sleep(0.01)
    assert got > 0
    stats = await session.stats()
    assert stats.turns == 1
    await session.close()


async def test_rss_after_50_sessions_within_10_percent_of_the_first() -> None:
    eng = spawn_engine(adapter="cascade", thinker={"max_reply_tokens": 8})
    try:
        client = await connect_engine(eng)
        await use_one_session(client, 0)
        await asyncio.sleep(0.5)
        first = (await client.ping()).rss_bytes
        for i in range(1, 50):
            await use_one_session(client, i)
        await asyncio.sleep(0.5)
        info = await client.ping()
        last = info.rss_bytes
        assert info.active_sessions == 0 and info.details["kv_bytes"] == 0
        growth = (last - first) / first
        print(
            f"engine RSS after 1 session {first / 2**20:.0f} MiB, after 50 {last / 2**20:.0f} MiB ({growth:+.1%})"
        )
        assert abs(growth) <= 0.10, f"RSS grew {growth:+.1%}: {first} -> {last}"
        await client.close()
    finally:
        eng.stop()
