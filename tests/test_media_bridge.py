"""The engine-session bridge (media/bridge.py) against a real engine process (loopback echo *test fixture*, no
models): its keep-alive rule, its event pump, and its close order.

The engine reaps sessions after their idle TTL (2 s here, asked for per session). A session with a bridge and no
caller audio is touched and survives several TTLs; one with caller audio streaming is not touched (the audio keeps
it alive); a session without a bridge is reaped, which shows the engine really reaps at this TTL.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from engine_bridge.formats import ENGINE_INPUT_RATE
from media.bridge import SessionBridge, keepalive_interval

#: In ``make test``, not the fast tier (docs/development.md, Test tiers): keep-alive and reaping timeouts of several seconds.
pytestmark = pytest.mark.slow

ENGINE_SETTINGS = {"adapter": "loopback", "loopback_delay_ms": 0}
TTL_S = 2.0


def test_keepalive_interval_is_a_quarter_of_the_ttl_and_at_least_a_second() -> None:
    assert keepalive_interval(120.0) == 30.0
    assert keepalive_interval(2.0) == 1.0


async def test_a_quiet_session_is_touched_and_survives(client: EngineClient) -> None:
    es = await client.open_session(p.SessionConfig(idle_ttl_s=TTL_S))
    assert es.idle_ttl_s == TTL_S  # reported by the engine at open
    events: list[p.SessionEvent] = []
    bridge = SessionBridge(es, events.append)
    bridge.start()
    try:
        await asyncio.sleep(TTL_S * 2.5)
        assert not es.closed, events
        assert bridge.touches >= 3
        assert not [e for e in events if isinstance(e, p.SessionError)]
    finally:
        await bridge.close()
    assert es.closed and bridge.closed


async def test_caller_audio_keeps_the_session_alive_without_touches(client: EngineClient) -> None:
    es = await client.open_session(p.SessionConfig(idle_ttl_s=TTL_S))
    bridge = SessionBridge(es, lambda ev: None)
    bridge.start()
    frame = np.zeros(ENGINE_INPUT_RATE // 50, dtype=np.int16)
    try:
        for _ in range(int(TTL_S * 2.5 * 50)):  # 20 ms frames at real time
            bridge.writer.write(frame)
            await asyncio.sleep(0.02)
        assert not es.closed
        assert bridge.touches == 0
    finally:
        await bridge.close()


async def test_without_a_bridge_the_session_is_reaped(client: EngineClient) -> None:
    es = await client.open_session(p.SessionConfig(idle_ttl_s=TTL_S))
    errors = []
    async with asyncio.timeout(TTL_S * 4):
        async for ev in es.iter_events():
            if isinstance(ev, p.SessionError):
                errors.append(ev.code)
    assert errors == ["idle_timeout"] and es.closed


async def test_the_pump_routes_model_text_to_the_player_and_every_event_to_the_consumer(
    client: EngineClient,
) -> None:
    es = await client.open_session(p.SessionConfig(idle_ttl_s=TTL_S))
    events: list[p.SessionEvent] = []
    got_text = asyncio.Event()

    def on_event(ev: p.SessionEvent) -> None:
        events.append(ev)
        if isinstance(ev, p.OutputTranscript):
            got_text.set()
        if isinstance(ev, p.ReplyStarted):
            raise RuntimeError("a failing handler does not stop the pump")

    bridge = SessionBridge(es, on_event)
    player = bridge.open_output(rate=24_000)
    bridge.start()
    try:
        frame = (np.sin(np.arange(ENGINE_INPUT_RATE // 50) / 3) * 8000).astype(np.int16)
        for _ in range(25):
            bridge.writer.write(frame)
            await asyncio.sleep(0.02)
        # Model text as the engine's control channel delivers it (the loopback adapter speaks no words).
        es._deliver(
            p.OutputTranscript(
                session_id=es.id, turn_id=1, epoch=0, text="hi", start_sample=10**9, end_sample=10**9 + 1
            )
        )
        await asyncio.wait_for(got_text.wait(), 5)
        assert player.stats()["transcripts_pending"] == 1  # handed to the player before the consumer saw it
        await es.close(p.CloseReason.CLIENT)
        async with asyncio.timeout(5):
            await bridge.wait()
        assert isinstance(events[-1], p.SessionClosed)
        assert any(isinstance(e, p.ReplyStarted) for e in events)  # the handler raised; the pump went on
    finally:
        await bridge.close()
