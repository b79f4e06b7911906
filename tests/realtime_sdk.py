"""The openai SDK's Realtime connection as the tests drive it: a microphone at real time, every server event logged
as the server sent it (parsed by the SDK as an application would), and validated against the SDK's types when the
connection closes (tests/realtime_checks.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from openai import AsyncOpenAI

from tests.conftest import ServerProcess
from tests.realtime_checks import ServerEventLog
from tests.speech_fixtures import synthesize_speech

#: The key the test servers are started with (LIVEKIT_OMNI_API_KEYS).
API_KEY = "sk-test"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."


class SdkCaller:
    """The openai SDK's Realtime connection, a microphone task at real time, and the log of every event."""

    def __init__(self, conn: Any, *, mic: bool = True) -> None:
        self.conn = conn
        self.log = ServerEventLog()
        self.mic: asyncio.Queue[np.ndarray] = asyncio.Queue()
        self.audio: dict[str, bytearray] = {}
        self._feeder = asyncio.create_task(self._feed() if mic else asyncio.sleep(0))

    async def _feed(self) -> None:
        """100 ms chunks at real time: queued speech, else silence (a live microphone never stops)."""
        t0 = time.monotonic()
        i = 0
        pending = np.zeros(0, np.int16)
        while True:
            while not self.mic.empty():
                pending = np.concatenate([pending, self.mic.get_nowait()])
            chunk, pending = pending[:2400], pending[2400:]
            if len(chunk) < 2400:
                chunk = np.concatenate([chunk, np.zeros(2400 - len(chunk), np.int16)])
            await self.conn.input_audio_buffer.append(
                audio=base64.b64encode(chunk.astype("<i2").tobytes()).decode()
            )
            i += 1
            await asyncio.sleep(max(0.0, t0 + i * 0.1 - time.monotonic()))

    def say(self, text: str) -> None:
        self.mic.put_nowait(synthesize_speech(text, rate=24000))

    async def next(self, timeout: float = 30) -> dict[str, Any]:
        # The frame as the server sent it (validated later), and parsed by the SDK as an application would.
        frame = await asyncio.wait_for(self.conn.recv_bytes(), timeout)
        self.conn.parse_event(frame)
        raw = json.loads(frame)
        if raw["type"] == "response.output_audio.delta":
            self.audio.setdefault(raw["response_id"], bytearray()).extend(base64.b64decode(raw["delta"]))
        return self.log.add(raw)

    async def logged(self, pred: Any, timeout: float = 40) -> dict[str, Any]:
        """The first event (already received or still to come) for which ``pred`` holds."""
        seen = next((e for e in self.log.events if pred(e)), None)
        deadline = time.monotonic() + timeout
        while seen is None:
            ev = await self.next(max(0.1, deadline - time.monotonic()))
            seen = ev if pred(ev) else None
        return seen

    async def until(self, etype: str, timeout: float = 40, **match: Any) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            ev = await self.next(max(0.1, deadline - time.monotonic()))
            if ev["type"] == etype and all(ev.get(k) == v for k, v in match.items()):
                return ev

    async def close(self) -> None:
        self._feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._feeder


@contextlib.asynccontextmanager
async def sdk_caller(
    server: ServerProcess,
    session: dict[str, Any],
    *,
    mic: bool = True,
    instructions: str = INSTRUCTIONS,
    api_key: str = API_KEY,
) -> AsyncIterator[SdkCaller]:
    """The SDK's ``client.realtime.connect()`` to ``server`` after its ``session.update`` (``session`` plus the
    ``instructions``); every event it received is validated against the SDK's types when it closes."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=api_key)
    async with client.realtime.connect(model="gpt-realtime") as conn:
        caller = SdkCaller(conn, mic=mic)
        try:
            created = await caller.next(10)
            assert created["type"] == "session.created", created
            await conn.session.update(session={"type": "realtime", "instructions": instructions, **session})
            updated = await caller.until("session.updated", 10)
            assert updated["session"]["instructions"] == instructions
            yield caller
        finally:
            await caller.close()
    caller.log.validate()
