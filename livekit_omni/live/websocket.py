"""The primary Live WebSocket (``/v1/live/sessions`` and ``/live/sessions``): auth, framing, limits, send queue.

Auth is checked *after* the upgrade: a bad key gets an ``error`` event (``invalid_api_key``, which LiveKit treats as
final) and close 1008, because a refused handshake is something LiveKit retries (docs/protocol.md).
Every message is one JSON object in a text frame. Outbound events go through one bounded queue drained by one
writer task, so the 20 ms output clock never waits on a slow client, events keep their order, and a client that
stops reading is disconnected instead of buffered without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from starlette.websockets import WebSocket

from livekit_omni import routing
from livekit_omni.auth import bearer_token, key_is_valid
from livekit_omni.drain import DRAINING_CODE, DRAINING_MESSAGE, Drain
from livekit_omni.live import wire
from livekit_omni.live.session import CLOSE_POLICY, CLOSE_TRY_AGAIN, LiveSession, hub_of

log = logging.getLogger(__name__)

#: A socket that never sends ``session.start`` is closed after this.
START_TIMEOUT_S: Final = 60.0
#: How long closing waits for queued events to reach the socket.
FLUSH_TIMEOUT_S: Final = 5.0
#: A client that closes with these (a close frame: it meant to leave) ends its session. A connection lost without
#: a close frame (1006: a network drop, a crashed client) or closed with another code detaches it for a resume.
DELIBERATE_CLOSE_CODES: Final = frozenset({1000, 1001})
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

    async def wait_closed(self) -> None:
        """Until the close of a client dropped for not reading has gone out or timed out (the connection ends when
        the handler returns, so it must not return before)."""
        if self._unread_close is not None:
            with contextlib.suppress(Exception):
                await self._unread_close


async def _refuse_draining(session: LiveSession, transport: WebSocketTransport) -> None:
    """No new session on a draining server: an error, then 1013, which tells the client to try again (elsewhere)."""
    session.state = "closed"
    session.hub.metrics.rejected_sessions.labels(reason=DRAINING_CODE).inc()
    session.emit(wire.error_event(DRAINING_CODE, DRAINING_MESSAGE, type=wire.SERVER_ERROR))
    await transport.close(CLOSE_TRY_AGAIN, DRAINING_CODE)


async def live_websocket(ws: WebSocket) -> None:
    await ws.accept()
    hub = hub_of(ws.app)
    transport = WebSocketTransport(ws, hub.settings.limits.outbound_queue_events)
    session = LiveSession(hub, transport)
    limit = hub.settings.limits.max_message_bytes
    client_close_code: int | None = None
    relayed = False
    try:
        if not key_is_valid(hub.settings, bearer_token(ws.headers)):
            session.state = "closed"
            hub.metrics.rejected_sessions.labels(reason="invalid_api_key").inc()
            session.emit(
                wire.error_event(
                    "invalid_api_key", "missing or invalid API key (send Authorization: Bearer <key>)"
                )
            )
            await transport.close(CLOSE_POLICY, "invalid_api_key")
            return
        drain: Drain = ws.app.state.drain
        while not transport.closed:
            # Draining (SIGTERM), checked on arrival and again before a session.start is handled.
            if session.state == "new" and not drain.admitting:
                await _refuse_draining(session, transport)
                return
            if session.state == "new":
                try:
                    msg = await asyncio.wait_for(ws.receive(), START_TIMEOUT_S)
                except TimeoutError:
                    session.emit(
                        wire.error_event(
                            "session_start_timeout", f"no session.start within {START_TIMEOUT_S:g} s"
                        )
                    )
                    await transport.close(CLOSE_POLICY, "session_start_timeout")
                    return
            else:
                msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                client_close_code = msg.get("code")
                return
            text = msg.get("text")
            data: str | bytes = text if text is not None else (msg.get("bytes") or b"")
            if _too_large(data, limit):
                session.emit(
                    wire.error_event(
                        "message_too_large",
                        f"a message may hold at most {limit} bytes; this one was dropped",
                    )
                )
                continue
            if session.state == "new" and not drain.admitting:
                await _refuse_draining(session, transport)
                return
            owner = routing.resume_owner(data) if session.state == "new" else None
            if owner is not None and await routing.relay_accepted_websocket(
                ws.app, ws.scope, ws.receive, ws.send, owner, data
            ):
                # Another worker holds the session (--workers): the connection was relayed there and is over.
                session.state = "closed"
                relayed = True
                return
            await session.handle_text(data)
            if session.successor is not None:
                # session.resume: this connection now belongs to the resumed session.
                session = session.successor
    except asyncio.CancelledError:
        if not transport.aborted:
            raise
        # The transport cancelled us because the client stopped reading: clean up and return normally.
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    finally:
        if relayed:
            # The relay sent the owner's close; no session was opened here.
            await transport.close(1000)
        else:
            hub.losses["events_unread"] += transport.unread
            # Detached for a resume (resume_grace_s), or ended. A client that stopped reading is not kept: what its
            # full queue held is lost, so a resume could not give it the session's output exactly.
            deliberate = client_close_code in DELIBERATE_CLOSE_CODES
            await session.transport_lost(transport, may_detach=not transport.aborted and not deliberate)
            await transport.close(CLOSE_TRY_AGAIN if transport.aborted else 1000)
            await transport.wait_closed()


async def receive_messages(
    ws: WebSocket,
    transport: WebSocketTransport,
    handle: Callable[[str | bytes], Awaitable[None]],
    *,
    limit: int,
    too_large: Callable[[str], None],
) -> None:
    """Hand each message of ``ws`` to ``handle`` until the client disconnects or the transport closes; a message
    over ``limit`` bytes goes to ``too_large`` (with the text of its error) instead. A client that stopped reading
    (the transport cancels this task then) ends it normally."""
    try:
        while not transport.closed:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            text = msg.get("text")
            data: str | bytes = text if text is not None else (msg.get("bytes") or b"")
            if _too_large(data, limit):
                too_large(f"a message may hold at most {limit} bytes; this one was dropped")
                continue
            await handle(data)
    except asyncio.CancelledError:
        if not transport.aborted:
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()


def _too_large(data: str | bytes, limit: int) -> bool:
    """Over ``limit`` bytes (a text frame is measured in UTF-8, encoded only when its length leaves it in doubt)."""
    n = len(data)
    return n > limit or (isinstance(data, str) and n * 4 > limit and len(data.encode()) > limit)
