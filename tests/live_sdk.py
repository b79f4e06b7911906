"""The openai SDK's Live connection as the tests drive it: a microphone at real time, every server event logged as
the server sent it (parsed by the SDK as an application would), and validated against the SDK's types when the
connection closes: each event against its member of ``openai.types.live.ServerEvent`` and, for ``response.event``,
the nested event against ``openai.types.responses.ResponseStreamEvent``, both in pydantic's strict mode."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import typing
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from openai import AsyncOpenAI
from openai.types.live import ServerEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter, ValidationError

from tests.conftest import ServerProcess
from tests.speech_fixtures import synthesize_speech

#: The key the test servers are started with (LIVEKIT_OMNI_API_KEYS).
API_KEY = "sk-test"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."

_LIVE_MEMBERS: dict[str, type[BaseModel]] = {
    typing.get_args(m.model_fields["type"].annotation)[0]: m
    for m in typing.get_args(typing.get_args(ServerEvent)[0])
}
_NESTED: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def validate_live_event(ev: dict[str, Any]) -> None:
    """Raise AssertionError if ``ev`` is not a valid Live server event (strict), nested Responses event included."""
    member = _LIVE_MEMBERS.get(str(ev.get("type")))
    assert member is not None, f"{ev.get('type')!r} is not a type of the Live ServerEvent union"
    try:
        member.model_validate(ev, strict=True)
        if ev["type"] == "response.event":
            nested = _NESTED.validate_python(ev["event"], strict=True)
            assert nested.type == ev["event"]["type"], (nested.type, ev["event"]["type"])
    except ValidationError as e:
        raise AssertionError(f"{ev['type']!r} does not validate against the SDK's types: {e}\n{ev}") from None


def nested(ev: dict[str, Any]) -> str:
    """The nested event type of a ``response.event`` ("" for other events)."""
    return str(ev["event"]["type"]) if ev["type"] == "response.event" else ""


class LiveSdkCaller:
    """The openai SDK's Live connection, a microphone task at real time, and the log of every event but audio."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.events: list[dict[str, Any]] = []
        self.audio_deltas = 0
        self.mic: asyncio.Queue[np.ndarray] = asyncio.Queue()
        self._feeder = asyncio.create_task(self._feed())

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
            await self.conn.session.input_audio.append(
                audio=base64.b64encode(chunk.astype("<i2").tobytes()).decode()
            )
            i += 1
            await asyncio.sleep(max(0.0, t0 + i * 0.1 - time.monotonic()))

    def say(self, text: str) -> None:
        self.mic.put_nowait(synthesize_speech(text, rate=24000))

    async def next(self, timeout: float = 30) -> dict[str, Any]:
        while True:
            frame = await asyncio.wait_for(self.conn.recv_bytes(), timeout)
            self.conn.parse_event(frame)  # as an application would
            ev = json.loads(frame)
            if ev["type"] == "session.output_audio.delta":
                self.audio_deltas += 1
                validate_live_event(ev)
                continue
            self.events.append(ev)
            return dict(ev)

    async def until(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 40, what: str = ""
    ) -> dict[str, Any]:
        """The next event for which ``pred`` holds (TimeoutError naming ``what`` after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no {what or 'matching event'} within {timeout} s; types: {self.types()[-30:]}"
                )
            try:
                ev = await self.next(left)
            except TimeoutError:
                continue
            if pred(ev):
                return ev

    async def until_type(self, etype: str, timeout: float = 40) -> dict[str, Any]:
        return await self.until(lambda e: e["type"] == etype, timeout, etype)

    async def quiet(self, seconds: float, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """Read for ``seconds``; the events for which ``pred`` held."""
        seen: list[dict[str, Any]] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = await self.next(left)
            except TimeoutError:
                break
            if pred(ev):
                seen.append(ev)
        return seen

    def types(self) -> list[str]:
        return [nested(e) or e["type"] for e in self.events]

    def said(self, since: int = 0) -> str:
        """The model's words (output transcript) in the events from index ``since`` on."""
        return "".join(
            e["delta"] for e in self.events[since:] if e["type"] == "session.output_transcript.delta"
        )

    async def close(self) -> None:
        self._feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._feeder

    def validate(self) -> int:
        assert self.events, "no server events were received, so none were validated"
        for ev in self.events:
            validate_live_event(ev)
        return len(self.events)


@contextlib.asynccontextmanager
async def live_caller(
    server: ServerProcess, session: dict[str, Any], *, instructions: str = INSTRUCTIONS
) -> AsyncIterator[LiveSdkCaller]:
    """The SDK's ``client.live.connect()`` to ``server``, started with ``session`` (plus the model, instructions
    and PCM 24 kHz); every event it received is validated against the SDK's types when it closes."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    async with client.live.connect() as conn:
        caller: LiveSdkCaller | None = None
        await conn.session.start(
            session={
                "model": "gpt-live-1",
                "instructions": instructions,
                "audio": {"format": {"type": "audio/pcm", "rate": 24000}},
                **session,
            },
            event_id="start",
        )
        first = json.loads(await asyncio.wait_for(conn.recv_bytes(), 30))
        assert first["type"] == "session.started", first
        caller = LiveSdkCaller(conn)
        caller.events.append(first)
        try:
            yield caller
        finally:
            await caller.close()
    caller.validate()
