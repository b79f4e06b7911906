"""A small asyncio client for the Live WebSocket, for tests, benchmarks and manual checks (not the product API).

It keeps the received output audio apart from the other events: audio deltas are recognised by the server's
fixed prefix and decoded (or, with ``decode_audio=False``, only counted, which is what a load generator wants);
every other event is parsed and queued for :meth:`LiveClient.next_event`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from typing import Any, Final

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

_AUDIO_PREFIX: Final = '{"type":"session.output_audio.delta","delta":"'
#: Non-audio events kept for the reader; a test that never reads them cannot grow this without bound.
EVENT_QUEUE_LIMIT: Final = 10_000


class LiveClient:
    def __init__(self, ws: ClientConnection, *, decode_audio: bool = True) -> None:
        self.ws = ws
        self.decode_audio = decode_audio
        #: Output audio as received (session format), and (arrival time, bytes) per delta.
        self.audio = bytearray()
        self.audio_bytes = 0
        self.deltas: list[tuple[float, int]] = []
        #: Every non-audio event in arrival order.
        self.events: list[dict[str, Any]] = []
        self.dropped_events = 0
        self.close_code: int | None = None
        self.close_reason = ""
        self.closed = asyncio.Event()
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(EVENT_QUEUE_LIMIT)
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        api_key: str | None = "sk-test",
        path: str = "/v1/live/sessions",
        decode_audio: bool = True,
        max_size: int | None = 16 * 1024 * 1024,
    ) -> LiveClient:
        url = base_url.replace("http://", "ws://").replace("https://", "wss://") + path
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        ws = await connect(url, additional_headers=headers, max_size=max_size, compression=None)
        return cls(ws, decode_audio=decode_audio)

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                text = msg if isinstance(msg, str) else msg.decode()
                if text.startswith(_AUDIO_PREFIX):
                    b64 = text[len(_AUDIO_PREFIX) : text.index('"', len(_AUDIO_PREFIX))]
                    n = len(b64) * 3 // 4 - b64.count("=")
                    self.audio_bytes += n
                    self.deltas.append((time.monotonic(), n))
                    if self.decode_audio:
                        self.audio += base64.b64decode(b64)
                    continue
                ev = json.loads(text)
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

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(event))

    async def send_raw(self, text: str) -> None:
        await self.ws.send(text)

    async def next_event(
        self, types: str | tuple[str, ...] | None = None, timeout: float = 10.0
    ) -> dict[str, Any]:
        """The next queued event (of ``types``, skipping others). Raises TimeoutError, or EOFError once closed."""
        want = (types,) if isinstance(types, str) else types
        deadline = time.monotonic() + timeout
        while True:
            if self._queue.empty() and self.closed.is_set():
                raise EOFError(f"connection closed ({self.close_code}) while waiting for {want}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no {want} within {timeout} s")
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
            if want is None or ev.get("type") in want:
                return ev

    async def start(self, session: dict[str, Any] | None = None, *, timeout: float = 15.0) -> dict[str, Any]:
        """``session.start`` → the ``session.started`` event (or the ``error`` that refused it)."""
        await self.send(
            {"type": "session.start", "event_id": "start", "session": session or {"model": "test"}}
        )
        return await self.next_event(("session.started", "error"), timeout)

    async def append_audio(self, raw: bytes, *, bytes_per_100ms: int, realtime: bool = True) -> None:
        """Stream ``raw`` (session format) in 100 ms appends, paced at real time unless ``realtime`` is False."""
        t0 = time.monotonic()
        for i, pos in enumerate(range(0, len(raw), bytes_per_100ms)):
            chunk = raw[pos : pos + bytes_per_100ms]
            await self.send({"type": "session.input_audio.append", "audio": base64.b64encode(chunk).decode()})
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
