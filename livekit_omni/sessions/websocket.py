"""The WebSocket transport both dialects use: one bounded outbound queue drained by one writer task, and the read loop.

Every message is one JSON object in a text frame. Outbound events go through one bounded queue drained by one
writer task, so the 20 ms output clock never waits on a slow client, events keep their order, and a client that
stops reading is disconnected instead of buffered without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Final

from starlette.websockets import WebSocket

from livekit_omni.sessions.transport import CLOSE_TRY_AGAIN

log = logging.getLogger(__name__)

#: How long closing waits for queued events to reach the socket.
FLUSH_TIMEOUT_S: Final = 5.0
#: A client dropped for not reading gets its 1013 close frame if it reads again within this; after it the
#: connection is closed without one.
UNREAD_CLOSE_TIMEOUT_S: Final = 10.0


class WebSocketTransport:
    kind = "websocket"
    carries_audio = True

    def __init__(self, ws: WebSocket, queue_limit: int) -> None:
        self.ws = ws
        self.closed = False
        #: Set when the client stopped reading and the connection is being dropped.
        self.aborted = False
        #: Events never sent because of that: the queue's content and the event that found it full.
        self.unread = 0
        self._q: asyncio.Queue[bytes | None] = asyncio.Queue(queue_limit)
        self._handler = asyncio.current_task()
        self._writer = asyncio.create_task(self._write(), name="live-ws-writer")
        self._close_lock = asyncio.Lock()
        self._unread_close: asyncio.Task[None] | None = None

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self._q.put_nowait(data)
        except asyncio.QueueFull:
            # The client has not read for many seconds: drop it (the handler's cleanup frees the session).
            log.warning(
                "live websocket: client stopped reading (%d events queued); dropping it", self._q.qsize()
            )
            self.closed = self.aborted = True
            self.unread = self._q.qsize() + 1
            self._writer.cancel()
            # What it never read is dropped now: the session's memory is the queue's bound, not the backlog.
            while not self._q.empty():
                self._q.get_nowait()
            if self._handler is not None:
                self._handler.cancel()

    async def put(self, data: bytes) -> None:
        if not self.closed:
            await self._q.put(data)

    async def _write(self) -> None:
        ws = self.ws
        try:
            while True:
                data = await self._q.get()
                if data is None:
                    return
                # Text frames only: LiveKit ignores binary ones. Encoded events are ASCII-safe JSON.
                await ws.send_text(data.decode())
        except asyncio.CancelledError:
            raise
        except Exception:  # the client is gone; the receive loop notices and cleans up
            self.closed = True

    async def close(self, code: int, reason: str = "") -> None:
        async with self._close_lock:
            if self.aborted:
                # A client that stopped reading cannot take a close frame until it reads again; wait for that off
                # this path (the session's engine resources are freed meanwhile), in :meth:`wait_closed`.
                if self._unread_close is None:
                    self._unread_close = asyncio.create_task(
                        self._close_unread(), name="live-ws-unread-close"
                    )
                return
            if self._writer.done() and self.closed:
                return
            self.closed = True
            if not self._writer.done():
                try:
                    self._q.put_nowait(None)
                except asyncio.QueueFull:
                    self._writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, TimeoutError, Exception):
                    await asyncio.wait_for(asyncio.shield(self._writer), FLUSH_TIMEOUT_S)
                self._writer.cancel()
            with contextlib.suppress(Exception):
                await self.ws.close(code, reason[:120])

    async def _close_unread(self) -> None:
        # uvicorn sends the frame once the client has drained the socket buffer (bounded: it writes only while the
        # socket is writable); a client that never reads again is closed without it when the handler returns.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.ws.close(CLOSE_TRY_AGAIN, "client_not_reading"), UNREAD_CLOSE_TIMEOUT_S
            )

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a read loop: when the client stops reading, the transport cancels the loop's task (see
        :meth:`send`); that cancellation ends the loop normally, so its cleanup runs. Any other one goes on."""
        try:
            yield
        except asyncio.CancelledError:
            if not self.aborted:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()

    async def wait_closed(self) -> None:
        """Until the close of a client dropped for not reading has gone out or timed out (the connection ends when
        the handler returns, so it must not return before)."""
        if self._unread_close is not None:
            with contextlib.suppress(Exception):
                await self._unread_close


async def receive_messages(
    ws: WebSocket,
    transport: WebSocketTransport,
    handle: Callable[[str | bytes], Awaitable[None]],
    *,
    limit: int,
    on_too_large: Callable[[str], None],
) -> None:
    """Hand each message of ``ws`` to ``handle`` until the client disconnects or the transport closes; a message
    over ``limit`` bytes goes to ``on_too_large`` (with the text of its error) instead. A client that stopped reading
    (the transport cancels this task then) ends it normally."""
    with transport.reading():
        while not transport.closed:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            data = payload(msg)
            if (refusal := oversize(data, limit)) is not None:
                on_too_large(refusal)
                continue
            await handle(data)


def payload(msg: Mapping[str, Any]) -> str | bytes:
    """What a received frame holds: its text, or its bytes."""
    text = msg.get("text")
    return text if text is not None else (msg.get("bytes") or b"")


def oversize(data: str | bytes, limit: int) -> str | None:
    """The refusal's text for a message over ``limit`` bytes (a text frame is measured in UTF-8, encoded only when
    its length leaves it in doubt), or None when it fits."""
    n = len(data)
    if n > limit or (isinstance(data, str) and n * 4 > limit and len(data.encode()) > limit):
        return f"a message may hold at most {limit} bytes; this one was dropped"
    return None
