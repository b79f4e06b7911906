"""The session core both dialects share (livekit_omni/sessions): the lifecycle table, the outbound size cap and the
event log, checked on the Realtime dialect (which had neither before it moved onto the core) and on Live.

A real ``livekit-omni serve`` with the loopback engine (no models): the cap and the log are the serving side's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from livekit_omni.sessions.eventlog import dialect_log_path
from livekit_omni.sessions.state import TRANSITIONS, IllegalTransition, SessionState
from tests.conftest import ServerProcess, start_server

#: The smallest outbound cap the settings allow.
OUTBOUND_CAP = 4 * 1024


@pytest.fixture(scope="module")
def event_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("core-log") / "events.jsonl"


@pytest.fixture(scope="module")
def server(event_log: Path) -> Iterator[ServerProcess]:
    s = start_server(
        adapter="loopback",
        env={
            "LIVEKIT_OMNI_LIMITS__MAX_OUTBOUND_BYTES": str(OUTBOUND_CAP),
            "LIVEKIT_OMNI_EVENT_LOG": str(event_log),
        },
    )
    yield s
    s.stop()


@contextlib.asynccontextmanager
async def socket(server: ServerProcess, path: str) -> AsyncIterator[Any]:
    async with websockets.connect(server.ws_url + path, max_size=None) as ws:
        yield ws


async def next_of(
    ws: Any, etype: str, frames: list[bytes] | None = None, timeout: float = 10.0
) -> dict[str, Any]:
    """The next event of ``etype``; every frame read on the way is kept in ``frames``."""
    deadline = time.monotonic() + timeout
    while True:
        raw = await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic()))
        data = raw.encode() if isinstance(raw, str) else raw
        if frames is not None:
            frames.append(data)
        ev = json.loads(data)
        if ev["type"] == etype:
            return ev


def test_the_lifecycle_table_allows_only_forward_moves() -> None:
    order = list(SessionState)
    for state, targets in TRANSITIONS.items():
        assert all(t > state for t in targets), (state, targets)
    assert TRANSITIONS[SessionState.CLOSED] == frozenset()
    assert SessionState.CLOSING.ending and SessionState.CLOSED.ending and not SessionState.ACTIVE.ending
    assert order == sorted(order)


def test_an_illegal_move_is_refused_and_leaves_the_state() -> None:
    from livekit_omni.realtime.session import RealtimeSession

    class _Null:
        kind = "websocket"
        carries_audio = True

        def send(self, data: bytes) -> None: ...

        async def put(self, data: bytes) -> None: ...

        async def close(self, code: int, reason: str = "") -> None: ...

    class _Hub:
        # Only what a session reads at construction.
        from livekit_omni.settings import Settings

        settings = Settings()
        metrics = None

    s = RealtimeSession(_Hub(), _Null())  # type: ignore[arg-type]
    assert s.state is SessionState.NEW
    with pytest.raises(IllegalTransition):
        s.advance(SessionState.ACTIVE)  # an engine session must be opening first
    assert s.state is SessionState.NEW
    s.advance(SessionState.CLOSED)
    with pytest.raises(IllegalTransition):
        s.advance(SessionState.OPENING)
    assert s.state is SessionState.CLOSED


async def test_realtime_refuses_an_outbound_event_over_the_cap_and_goes_on(server: ServerProcess) -> None:
    big = "x" * (OUTBOUND_CAP * 2)
    async with socket(server, "/v1/realtime?model=m") as ws:
        await next_of(ws, "session.created")
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "id": "big",
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": big}],
                    },
                }
            )
        )
        frames: list[bytes] = []
        err = await next_of(ws, "error", frames)
        assert err["error"]["code"] == "event_too_large", err
        assert all(len(f) <= OUTBOUND_CAP for f in frames), [len(f) for f in frames]
        # The session goes on: a small item is added as usual, and the big one is in the table all the same.
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "id": "small",
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "hi"}],
                    },
                }
            )
        )
        added = await next_of(ws, "conversation.item.added")
        assert added["item"]["id"] == "small"


async def test_live_slims_a_session_resource_over_the_cap(server: ServerProcess) -> None:
    async with socket(server, "/v1/live/sessions") as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "session.start",
                    "session": {
                        "model": "m",
                        "instructions": "Be brief. " * (OUTBOUND_CAP // 5),
                        "audio": {"format": {"type": "audio/pcm", "rate": 24000}},
                    },
                }
            )
        )
        raw = await asyncio.wait_for(ws.recv(), 30)
        assert len(raw) <= OUTBOUND_CAP
        started = json.loads(raw)
        assert started["type"] == "session.started", started
        assert "instructions" not in started["session"]


async def test_realtime_writes_every_frame_it_sends_to_its_event_log(
    server: ServerProcess, event_log: Path
) -> None:
    received: list[bytes] = []
    async with socket(server, "/v1/realtime?model=m") as ws:
        await next_of(ws, "session.created", received)
        marker = "log-check-item"
        await ws.send(
            json.dumps(
                {
                    "type": "conversation.item.create",
                    "item": {
                        "id": marker,
                        "type": "message",
                        "role": "user",
                        "content": [{"type": "input_text", "text": "hello"}],
                    },
                }
            )
        )
        await next_of(ws, "conversation.item.done", received)
    path = dialect_log_path(event_log, "realtime")
    deadline = time.monotonic() + 10
    logged: list[bytes] = []
    while time.monotonic() < deadline:
        logged = path.read_bytes().splitlines() if path.is_file() else []
        if any(marker.encode() in line and b"conversation.item.done" in line for line in logged):
            break
        await asyncio.sleep(0.1)
    # Every frame this client read is in the log, byte for byte and in the same order (other sessions' frames of
    # this module's server may sit between them).
    it = iter(logged)
    missing = [f for f in received if not any(f == line for line in it)]
    assert not missing, missing[:3]
    # The Live dialect logs to its own file: none of these frames is there.
    live = dialect_log_path(event_log, "live")
    live_lines = set(live.read_bytes().splitlines()) if live.is_file() else set()
    assert not live_lines & set(received)
