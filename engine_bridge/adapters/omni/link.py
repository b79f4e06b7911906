"""The bridge's transport: one asyncio loop thread per adapter, one WebSocket link per engine session.

The engine's threads are not asyncio (the audio thread must never wait on a socket), so every link lives on one
:class:`BridgeLoop`, a private event loop on its own thread; the other threads hand it work with
:meth:`BridgeLoop.call` (fire and forget) or :meth:`BridgeLoop.submit` (a future to wait on).

An :class:`OmniLink` owns one vLLM-Omni duplex session: the handshake, an ordered writer, a reader that drops
events replayed twice, the (cumulative) acknowledgement of the newest ``server_event_seq``, the heartbeat, and the resume after a dropped
socket (``session.resume`` with the last resume token, inside ``resume_window_s``). A link that cannot resume
reports itself lost once, to its :class:`LinkHandler`; the adapter turns that into a typed session error.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, Protocol, TypeVar

import aiohttp

from engine_bridge.adapters.omni import dialect as d

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Frames queued while a link resumes (control frames and the newest caller audio); older ones are dropped.
RESUME_BUFFER_FRAMES: Final = 256
_MAX_FRAME_BYTES: Final = 64 << 20


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (it comes with ``uvicorn[standard]``): less CPU per frame on this hot loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class BridgeLoop:
    """A private asyncio loop on a daemon thread, plus the HTTP client session every link shares."""

    def __init__(self, name: str = "omni-bridge") -> None:
        self.loop = _new_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._http: aiohttp.ClientSession | None = None
        self._started = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._started and self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop thread soon; never blocks the caller."""
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing left to tell
            self.loop.call_soon_threadsafe(fn, *args)

    def http(self) -> aiohttp.ClientSession:
        """The shared client session (loop thread only)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0))
        return self._http

    def stop(self) -> None:
        if not self.running:
            return

        async def _close() -> None:
            if self._http is not None:
                await self._http.close()

        with contextlib.suppress(Exception):
            self.submit(_close()).result(timeout=5.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


class LinkStatus(enum.StrEnum):
    CONNECTING = "connecting"
    OPEN = "open"
    RESUMING = "resuming"
    CLOSED = "closed"
    LOST = "lost"


class LinkRefused(Exception):
    """The sidecar refused the session (an ``error`` event instead of ``session.created``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class LinkHandler(Protocol):
    def on_event(self, ev: dict[str, Any]) -> None: ...

    def on_lost(self, reason: str) -> None: ...


class OmniLink:
    """One vLLM-Omni duplex session over one (resumable) WebSocket. Loop thread only."""

    def __init__(
        self,
        bridge: BridgeLoop,
        url: str,
        handler: LinkHandler,
        *,
        handshake_timeout_s: float,
        resume_window_s: float,
        heartbeat_s: float,
    ) -> None:
        self.bridge = bridge
        self.url = url
        self.handler = handler
        self.handshake_timeout_s = handshake_timeout_s
        self.resume_window_s = resume_window_s
        self.heartbeat_s = heartbeat_s
        self.status = LinkStatus.CONNECTING
        self.session_id = ""
        self.resume_token: str | None = None
        self.session_info: dict[str, Any] = {}
        self.last_seq = 0
        self._acked_seq = 0
        self.resumes = 0
        self.sent_frames = 0
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._outq: asyncio.Queue[str] = asyncio.Queue()
        self._held: collections.deque[str] = collections.deque(maxlen=RESUME_BUFFER_FRAMES)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    # --- lifecycle -----------------------------------------------------------------------------------------
    async def open(self, session: dict[str, Any]) -> dict[str, Any]:
        """Connect, send ``session.update``, wait for ``session.created``; returns it. Raises
        :class:`LinkRefused` for an ``error`` answer, ``OSError``/``aiohttp.ClientError``/``TimeoutError`` when the
        sidecar cannot be reached."""
        ws = await self.bridge.http().ws_connect(self.url, max_msg_size=_MAX_FRAME_BYTES, autoping=True)
        try:
            await ws.send_str(d.encode(d.SessionUpdate(session=session)))
            async with asyncio.timeout(self.handshake_timeout_s):
                while True:
                    msg = await ws.receive()
                    if msg.type is not aiohttp.WSMsgType.TEXT:
                        raise ConnectionError(
                            f"the sidecar closed the socket during the handshake ({msg.type.name})"
                        )
                    ev = d.decode_event(msg.data)
                    kind = ev.get("type")
                    if kind == "error":
                        code, message = d.error_code(ev)
                        raise LinkRefused(code, message)
                    self._note_seq(ev)
                    if kind == "session.created":
                        break
        except BaseException:
            await ws.close()
            raise
        self._adopt(ev)
        self._ws = ws
        self.status = LinkStatus.OPEN
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"omni-read-{self.session_id}"),
            asyncio.create_task(self._write_loop(), name=f"omni-write-{self.session_id}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"omni-heartbeat-{self.session_id}"),
        ]
        return ev

    async def close(self, reason: str = "client_close") -> None:
        """``session.close`` (best effort), then drop the socket; idempotent."""
        if self._closing:
            return
        self._closing = True
        ws = self._ws
        if ws is not None and not ws.closed and self.status is LinkStatus.OPEN:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.send_str(d.encode(d.CloseSession(reason=reason))), 1.0)
        self.status = LinkStatus.CLOSED
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()

    # --- sending -------------------------------------------------------------------------------------------
    def send(self, cmd: d.Command) -> None:
        """Queue one client event, in order. While resuming it is held (the oldest dropped past the bound)."""
        if self.status is LinkStatus.OPEN:
            self._outq.put_nowait(d.encode(cmd))
        elif self.status in (LinkStatus.RESUMING, LinkStatus.CONNECTING):
            self._held.append(d.encode(cmd))

    async def _write_loop(self) -> None:
        while True:
            frame = await self._outq.get()
            ws = self._ws
            if ws is None or ws.closed or self.status is not LinkStatus.OPEN:
                self._held.append(frame)
                continue
            try:
                await ws.send_str(frame)
                self.sent_frames += 1
            except (ConnectionError, aiohttp.ClientError, RuntimeError):
                self._held.append(frame)  # the reader sees the drop and resumes; this goes out after

    def flush_event_ack(self) -> None:
        """``session.event_ack`` of the newest event seen, if newer than the last one acknowledged. The server's
        journal drops everything up to it (the ack is cumulative), so the adapter's periodic tick calling this
        does what one ack per event would, at a fraction of the frames."""
        if self.last_seq > self._acked_seq and self.status is LinkStatus.OPEN:
            self._acked_seq = self.last_seq
            self.send(d.EventAck(server_event_seq=self._acked_seq))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.send(d.Heartbeat())

    # --- receiving -----------------------------------------------------------------------------------------
    def _note_seq(self, ev: dict[str, Any]) -> bool:
        """Track ``server_event_seq``; False for a duplicate (resume replays events already seen)."""
        seq = ev.get("server_event_seq")
        if isinstance(seq, int):
            if seq <= self.last_seq:
                return False
            self.last_seq = seq
        return True

    def _adopt(self, ev: dict[str, Any]) -> None:
        session = ev.get("session")
        if isinstance(session, dict):
            self.session_info = session
            sid = session.get("session_id") or session.get("id")
            if isinstance(sid, str) and sid:
                self.session_id = sid
        if not self.session_id and isinstance(ev.get("session_id"), str):
            self.session_id = ev["session_id"]
        token = ev.get("resume_token")
        if isinstance(token, str) and token:
            self.resume_token = token

    def _deliver(self, ev: dict[str, Any]) -> None:
        if not self._note_seq(ev):
            return
        kind = ev.get("type")
        if kind == "session.resync_required":
            self.resume_token = None  # the server stopped journaling: a resume would be refused
        try:
            self.handler.on_event(ev)
        except Exception:
            log.exception("omni link %s: handling %s failed", self.session_id, kind)

    async def _read_loop(self) -> None:
        while True:
            ws = self._ws
            assert ws is not None
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.TEXT:
                    try:
                        ev = d.decode_event(msg.data)
                    except Exception:
                        log.warning("omni link %s: undecodable frame %.200r", self.session_id, msg.data)
                        continue
                    self._deliver(ev)
                    if ev.get("type") in ("session.closed", "session.expired"):
                        self.status = LinkStatus.CLOSED
                        return
                elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break
            if self._closing:
                return
            log.warning("omni link %s: the socket dropped; resuming", self.session_id)
            if not await self._resume():
                self.status = LinkStatus.LOST
                self.handler.on_lost("the vLLM-Omni sidecar went away and the session could not be resumed")
                return

    async def _resume(self) -> bool:
        """Re-attach to the same sidecar session (``DuplexClient._attempt_resume``); False when it cannot."""
        self.status = LinkStatus.RESUMING
        if not self.resume_token or not self.session_id:
            return False
        deadline = time.monotonic() + self.resume_window_s
        delay = 0.05
        while not self._closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)
            try:
                ws = await self.bridge.http().ws_connect(self.url, max_msg_size=_MAX_FRAME_BYTES)
            except (OSError, aiohttp.ClientError, TimeoutError):
                continue
            outcome = await self._resume_on(ws)
            if outcome is True:
                return True
            with contextlib.suppress(Exception):
                await ws.close()
            if outcome is False:
                return False
        return False

    async def _resume_on(self, ws: aiohttp.ClientWebSocketResponse) -> bool | None:
        """One resume attempt: True resumed, False refused for good, None try again."""
        assert self.resume_token is not None
        resume = d.SessionResume(
            session_id=self.session_id,
            resume_token=self.resume_token,
            last_received_server_event_seq=self.last_seq,
        )
        pending: list[dict[str, Any]] = []
        try:
            await ws.send_str(d.encode(resume))
            async with asyncio.timeout(self.handshake_timeout_s):
                while True:
                    msg = await ws.receive()
                    if msg.type is not aiohttp.WSMsgType.TEXT:
                        return None
                    ev = d.decode_event(msg.data)
                    kind = ev.get("type")
                    if kind == "session.resumed":
                        break
                    if kind == "session.resync_required":
                        return False
                    if kind == "error":
                        code, _ = d.error_code(ev)
                        return False if code in d.FATAL_RESUME_CODES else None
                    pending.append(ev)  # replayed journal entries may precede the confirmation
        except (TimeoutError, ConnectionError, aiohttp.ClientError):
            return None
        self._adopt(ev)
        self._ws = ws
        self.status = LinkStatus.OPEN
        self.resumes += 1
        log.info("omni link %s: resumed (attempt %d)", self.session_id, self.resumes)
        for item in pending:
            self._deliver(item)
        while self._held:
            self._outq.put_nowait(self._held.popleft())
        return True
