"""Server-side ends of a Realtime session: lifetime expiry, the engine dying mid-session, and server shutdown.

A loopback server is enough (none of this needs speech); each test gets its own, since each ends it or its engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import websockets

from tests.conftest import ServerProcess, start_server
from tests.realtime_checks import ServerEventLog

SILENCE = base64.b64encode(bytes(4800)).decode()  # 100 ms of PCM16 24 kHz


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    s = start_server(adapter="loopback", env={"LIVEKIT_OMNI_LIMITS__SESSION_LIFETIME_S": "2.0"})
    yield s
    s.stop()


async def _open(server: ServerProcess) -> tuple[Any, ServerEventLog]:
    ws = await websockets.connect(
        server.url.replace("http://", "ws://") + "/v1/realtime?model=m", max_size=None
    )
    log = ServerEventLog()
    log.add(await asyncio.wait_for(ws.recv(), 5))
    await ws.send(
        json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE})
    )  # opens the engine session
    return ws, log


async def _until_closed(ws: Any, log: ServerEventLog, timeout: float = 10.0) -> int:
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            log.add(await asyncio.wait_for(ws.recv(), timeout))
    return int(ws.close_code)


async def test_lifetime_reached_gets_session_expired_and_1000(server: ServerProcess) -> None:
    ws, log = await _open(server)
    assert await _until_closed(ws, log) == 1000
    assert [e["error"]["code"] for e in log.of("error")] == ["session_expired"]
    log.validate()


async def test_engine_lost_gets_an_error_and_1011(server: ServerProcess) -> None:
    ws, log = await _open(server)
    await asyncio.wait_for(_wait_type(ws, log, "response.created"), 5)
    os.kill(server.engine_pid(), signal.SIGKILL)
    assert await _until_closed(ws, log) == 1011
    assert log.of("error")[-1]["error"]["code"] == "engine_lost"
    # Every response that began was closed with response.done first.
    assert len(log.of("response.done")) == len(log.of("response.created"))
    log.validate()


async def test_server_shutdown_closes_with_1012(server: ServerProcess) -> None:
    """1012 (service restart) is a close the SDK and LiveKit reconnect on. (Uvicorn closes open sockets with
    1012 itself when it stops, before the app's own shutdown could send an ``error`` first.)"""
    ws, log = await _open(server)
    await asyncio.wait_for(_wait_type(ws, log, "response.created"), 5)
    server.proc.send_signal(signal.SIGINT)
    assert await _until_closed(ws, log) == 1012
    log.validate()


async def _wait_type(ws: Any, log: ServerEventLog, etype: str) -> None:
    while log.add(await ws.recv())["type"] != etype:
        pass
