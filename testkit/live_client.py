"""A small asyncio client of the Live WebSocket, for tests, benchmarks and manual checks (not the product API).

Every frame the server sends is decoded with the protocol's own types (:func:`livekit_omni.live.wire.
decode_server_event`), so an event the types do not accept (an unknown ``type``, a missing or mistyped field)
is a protocol violation: it is recorded in :attr:`LiveClient.violations` and the next :meth:`LiveClient.next_event`
raises :class:`ProtocolViolation`. Output audio is kept apart from the other events: its bytes accumulate in
:attr:`LiveClient.audio` (or, with ``keep_audio=False``, are only counted, which is what a load generator wants);
every other event is queued for :meth:`LiveClient.next_event`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from typing import Any, Final, TypeVar

import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from livekit_omni.live import wire

#: Non-audio events kept for the reader; a test that never reads them cannot grow this without bound.
EVENT_QUEUE_LIMIT: Final = 10_000

E = TypeVar("E", bound=wire.ServerEvent)


class ProtocolViolation(AssertionError):
    """The server sent a frame that is not a valid event of the Live protocol."""


class LiveClient:
    def __init__(self, ws: ClientConnection, *, keep_audio: bool = True) -> None:
        self.ws = ws
        self.keep_audio = keep_audio
        #: Output audio as received (session format), and (arrival time, bytes) per delta.
        self.audio = bytearray()
        self.audio_bytes = 0
        self.deltas: list[tuple[float, int]] = []
        #: Every non-audio event in arrival order.
        self.events: list[wire.ServerEvent] = []
        #: Frames that did not decode as server events (what was wrong, and the start of the frame).
        self.violations: list[str] = []
        self.dropped_events = 0
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed = asyncio.Event()
        self._queue: asyncio.Queue[wire.ServerEvent] = asyncio.Queue(EVENT_QUEUE_LIMIT)
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        api_key: str | None = "sk-test",
        path: str = "/v1/live/sessions",
        keep_audio: bool = True,
        max_size: int | None = 16 * 1024 * 1024,
    ) -> LiveClient:
        url = base_url.replace("http://", "ws://").replace("https://", "wss://") + path
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        ws = await connect(url, additional_headers=headers, max_size=max_size, compression=None)
        return cls(ws, keep_audio=keep_audio)

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                try:
                    ev = wire.decode_server_event(msg)
                except (wire.UnknownServerEvent, msgspec.DecodeError) as e:
                    self.violations.append(f"{e}: {str(msg)[:200]}")
                    continue
                if isinstance(ev, wire.OutputAudioDelta):
                    n = len(ev.delta)
                    self.audio_bytes += n
                    self.deltas.append((time.monotonic(), n))
                    if self.keep_audio:
                        self.audio += ev.delta
                    continue
                self.events.append(ev)
                try:
                    self._queue.put_nowait(ev)
                except asyncio.QueueFull:
                    self.dropped_events += 1
        except ConnectionClosed:
            pass
        finally:
            self.close_code = self.ws.close_code
            self.close_reason = self.ws.close_reason or ""
            self.closed.set()

    async def send(self, command: wire.ClientCommand | dict[str, Any]) -> None:
        """Send a command; a dict is sent as given (tests use it for malformed commands)."""
        data = json.dumps(command) if isinstance(command, dict) else wire.encode(command).decode()
        await self.ws.send(data)

    async def send_raw(self, text: str) -> None:
        await self.ws.send(text)

    def _check(self) -> None:
        if self.violations:
            raise ProtocolViolation(f"{len(self.violations)} invalid frames, e.g. {self.violations[0]}")

    async def next_event(self, types: type[E] | tuple[type[E], ...], timeout: float = 10.0) -> E:
        """The next queued event of ``types``, skipping others. Raises TimeoutError, EOFError once closed, or
        :class:`ProtocolViolation` once the server has sent an invalid frame."""
        deadline = time.monotonic() + timeout
        while True:
            self._check()
            if self._queue.empty() and self.closed.is_set():
                raise EOFError(f"connection closed ({self.close_code}) while waiting for {types}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {types} within {timeout} s")
            get = asyncio.ensure_future(self._queue.get())
            closed = asyncio.ensure_future(self.closed.wait())
            done, _ = await asyncio.wait(
                {get, closed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            closed.cancel()
            if get not in done:
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await get
                continue
            ev = get.result()
            if isinstance(ev, types):
                return ev

    def of(self, kind: type[E]) -> list[E]:
        """The events of ``kind`` received so far."""
        return [e for e in self.events if isinstance(e, kind)]

    async def start(
        self, session: dict[str, Any] | None = None, *, timeout: float = 15.0
    ) -> wire.SessionStarted | wire.Error:
        """``session.start`` → the ``session.started`` event (or the ``error`` that refused it).

        A server that refuses every new session (draining, a bad key) may send its error and close before this
        command goes out; the error is still read from what was received."""
        with contextlib.suppress(ConnectionClosed):
            await self.send(
                {"type": "session.start", "event_id": "start", "session": session or {"model": "test"}}
            )
        return await self.next_event((wire.SessionStarted, wire.Error), timeout)

    async def resume(self, token: str, *, timeout: float = 15.0) -> wire.SessionStarted | wire.Error:
        """``session.resume`` with ``token`` → the ``session.started`` of the resumed session (or the refusal)."""
        await self.send({"type": "session.resume", "event_id": "resume", "resume_token": token})
        return await self.next_event((wire.SessionStarted, wire.Error), timeout)

    async def append_audio(self, raw: bytes, *, bytes_per_100ms: int, realtime: bool = True) -> None:
        """Stream ``raw`` (session format) in 100 ms appends, paced at real time unless ``realtime`` is False."""
        t0 = time.monotonic()
        for i, pos in enumerate(range(0, len(raw), bytes_per_100ms)):
            chunk = raw[pos : pos + bytes_per_100ms]
            await self.send(wire.InputAudioAppend(audio=base64.b64encode(chunk).decode()))
            if realtime:
                await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.1 - time.monotonic()))

    async def wait_closed(self, timeout: float = 10.0) -> int | None:
        await asyncio.wait_for(self.closed.wait(), timeout)
        return self.close_code

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
