"""What every dialect session is: one client connection projected onto one engine session, with one lifecycle.

:class:`DialectSession` owns what does not depend on the dialect, so each dialect (Live, Realtime, and a SIP call's
control to come) supplies only its wire codec, its dispatch of client commands and its projection of engine events:

* the lifecycle: a :class:`~livekit_omni.sessions.state.SessionState` changed only by :meth:`advance`, which checks
  the move against the table;
* the way out: :meth:`emit` (the allowed-events filter, the outbound size cap, error metrics) and
  :meth:`send_frame`, through which every frame leaves, so the event log holds exactly what crossed the wire;
* the way in: :meth:`handle_text` decodes one client message, filters it and hands it to the dialect's
  :meth:`receive`; refusals become ``error`` events and the session goes on whenever it can;
* the engine session: :meth:`open_engine` (through the hub's admission) and the engine events every dialect treats
  alike (the engine closing the session, errors, barge-in counts, context usage), before the dialect's own
  projection (:meth:`on_engine_event`);
* input backpressure, the 1 s housekeeping (lifetime, plus the dialect's :meth:`on_housekeeping`), and the end:
  :meth:`end` runs once, sends the dialect's last events (:meth:`farewell`), closes the transport, then the engine
  session; :meth:`abort` is the end with an error.

All of it runs on the serving process's event loop and never blocks it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic

from engine_bridge import protocol as p
from engine_bridge.client import EngineSession
from engine_bridge.control import ControlError, EngineLostError, EngineRequestError
from livekit_omni import worker_ids
from livekit_omni.sessions.backpressure import InputBudget, InputVerdict
from livekit_omni.sessions.codec import Command, Event, WireCodec
from livekit_omni.sessions.errors import SERVER_ERROR, WireError
from livekit_omni.sessions.eventlog import event_log
from livekit_omni.sessions.hub import TRY_AGAIN_CODES, SessionHub
from livekit_omni.sessions.state import TRANSITIONS, IllegalTransition, SessionState
from livekit_omni.sessions.transport import CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_TRY_AGAIN, Transport
from media.bridge import SessionBridge

if TYPE_CHECKING:
    from livekit_omni.sessions.eventlog import EventLog

log = logging.getLogger(__name__)

#: Commands to the engine that do not answer within this are reported as an error (the session goes on).
ENGINE_REQUEST_TIMEOUT_S: Final = 5.0
#: Engine failures of a single command: reported, not fatal (the engine-event pump ends the session if it is gone).
ENGINE_COMMAND_ERRORS: Final = (EngineLostError, EngineRequestError, ControlError, TimeoutError)


class DialectSession(ABC, Generic[Command, Event]):
    """One session of one dialect over one transport. See the module docstring."""

    #: ``live``, ``realtime``: names its event log and its log lines.
    dialect: ClassVar[str]
    #: Its session ids start with this (``live_``, ``sess_``).
    id_prefix: ClassVar[str]

    def __init__(self, hub: SessionHub, transport: Transport, codec: WireCodec[Command, Event]) -> None:
        #: The dialect's wire: decoding, encoding and its error event.
        self.codec = codec
        self.hub = hub
        self.transport = transport
        self.settings = hub.settings
        self.metrics = hub.metrics
        self.id = self.id_prefix + worker_ids.tagged(secrets.token_hex(12))
        self._state = SessionState.NEW
        self.engine: EngineSession | None = None
        #: The engine session's media, event pump and keep-alive (made when the engine session opens).
        self.bridge: SessionBridge | None = None
        #: When the session's clocks started (monotonic; 0 until then).
        self.started_at = 0.0
        #: Data-channel filters (``session.client.data_channel``): None lets every event through.
        self.allowed_client_events: frozenset[str] | None = None
        self.allowed_server_events: frozenset[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._log: EventLog | None = event_log(self.dialect)
        limits = self.settings.limits
        self._budget = InputBudget(
            burst_s=limits.input_burst_s, grace_s=limits.input_backpressure_grace_s, now=time.monotonic()
        )
        #: The engine's latest context size and limit (tokens), from its ``Usage`` events.
        self.context: tuple[int, int] | None = None
        #: A fatal engine error, reported when the engine then closes the session.
        self._fatal: p.SessionError | None = None

    # --- the dialect's part -----------------------------------------------------------------------------------
    @abstractmethod
    async def receive(self, cmd: Command) -> None:
        """Carry out one decoded client command (the dialect's dispatch). Raise :class:`WireError` to refuse it."""

    @abstractmethod
    def on_engine_event(self, ev: p.SessionEvent) -> None:
        """The dialect's projection of one engine event (after the shared handling in :meth:`_on_engine_event`)."""

    @abstractmethod
    def farewell(self, *, was_active: bool, error: Event | None) -> None:
        """The dialect's last events, sent while the session is ``CLOSING`` (``error`` first where it belongs)."""

    @abstractmethod
    def tick(self) -> None:
        """Produce one 20 ms output frame (WebSocket sessions, from the hub's clock)."""

    def slim(self, ev: Event) -> Event | None:
        """A smaller form of an event over the outbound limit, or None when the dialect has none."""
        return None

    def on_housekeeping(self, now: float) -> None:
        """Once a second while active (the dialect's own timers)."""

    async def expire(self) -> None:
        """The session reached its lifetime: end it as the dialect tells its clients."""
        await self.abort("session_expired", "the session reached its lifetime", close_code=CLOSE_NORMAL)

    @property
    def metrics_label(self) -> str:
        """The ``transport`` label of the session metrics."""
        return self.transport.kind

    # --- the lifecycle ----------------------------------------------------------------------------------------
    @property
    def state(self) -> SessionState:
        return self._state

    def advance(self, to: SessionState) -> None:
        """The one place the state changes: the move must be in the table (docs/architecture.md, Dialect sessions)."""
        if to not in TRANSITIONS[self._state]:
            raise IllegalTransition(self.id, self._state, to)
        self._state = to

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def usage_seconds(self) -> float:
        return round(time.monotonic() - self.started_at, 1) if self.started_at else 0.0

    # --- the way out ------------------------------------------------------------------------------------------
    def emit(self, ev: Event) -> None:
        """Send one server event: filtered by the allowed events, held to ``max_outbound_bytes``, counted."""
        if self._state is SessionState.CLOSED:
            return
        etype = self.codec.event_type(ev)
        if self.allowed_server_events is not None and etype not in self.allowed_server_events:
            return
        data = self.codec.encode(ev)
        if len(data) > self.settings.limits.max_outbound_bytes:
            data = self._shrink(ev, etype)
        code = self.codec.error_code(ev)
        if code:
            self.metrics.errors.labels(code=code).inc()
        self.send_frame(data)

    def send_frame(self, data: bytes, *, to: Transport | None = None) -> None:
        """Every frame leaves through here, so the event log holds exactly what crossed the wire (``to``: a transport
        that is not yet the session's, such as a resuming client's)."""
        if self._log is not None:
            self._log.write(data)
        (to or self.transport).send(data)

    def emit_error(self, e: WireError, client_event_id: str | None = None) -> None:
        self.emit(
            self.codec.error_event(
                e.code,
                e.message,
                type=e.type,
                param=e.param,
                client_event_id=e.client_event_id or client_event_id,
            )
        )

    def _shrink(self, ev: Event, etype: str) -> bytes:
        """An event over ``max_outbound_bytes`` (clients break on large frames): the dialect's slimmer form, and if
        that is still too large (or there is none) an ``event_too_large`` error in its place."""
        limit = self.settings.limits.max_outbound_bytes
        slim = self.slim(ev)
        data = self.codec.encode(slim) if slim is not None else b""
        if slim is None or len(data) > limit:
            log.error(
                "session %s: dropped a %s event (over the outbound limit of %d bytes)", self.id, etype, limit
            )
            self.hub.losses["events_too_large"] += 1
            data = self.codec.encode(
                self.codec.error_event(
                    "event_too_large", f"a {etype} event was too large to send", type=SERVER_ERROR
                )
            )
        return data

    # --- the way in -------------------------------------------------------------------------------------------
    async def handle_text(self, raw: str | bytes) -> None:
        """One client message. Errors become ``error`` events; the session goes on whenever it can."""
        if self._state.ending:
            return
        try:
            cmd = self.codec.decode(raw)
        except WireError as e:
            self.emit_error(e)
            return
        cid = self.codec.client_event_id(cmd)
        ctype = self.codec.event_type(cmd)
        if self.allowed_client_events is not None and ctype not in self.allowed_client_events:
            self.emit(
                self.codec.error_event(
                    "event_not_allowed",
                    f"{ctype} is not allowed on this data channel (session.client.data_channel)",
                    param="type",
                    client_event_id=cid,
                )
            )
            return
        try:
            await self.receive(cmd)
        except WireError as e:
            self.emit_error(e, cid)
            if e.type == SERVER_ERROR and (e.code in TRY_AGAIN_CODES or e.code == "engine_error"):
                # The engine session could not open: the session cannot go on (clients retry on 1013).
                await self.end(
                    code=CLOSE_TRY_AGAIN if e.code in TRY_AGAIN_CODES else CLOSE_INTERNAL, reason=e.code
                )
        except ENGINE_COMMAND_ERRORS as e:
            self.emit(
                self.codec.error_event(
                    "engine_error",
                    f"the engine did not complete {ctype}: {e}",
                    type=SERVER_ERROR,
                    client_event_id=cid,
                )
            )

    async def refuse(self, e: WireError, *, close_code: int, client_event_id: str | None = None) -> None:
        """Refuse the connection before a session started (a bad key, a draining server, a bad configuration): the
        ``error``, then close ``close_code``; counted in ``rejected_sessions``."""
        self.metrics.rejected_sessions.labels(reason=e.code).inc()
        self.emit_error(e, client_event_id)
        self.advance(SessionState.CLOSED)
        await self.transport.close(close_code, e.code)

    def admit_input(self, seconds: float) -> bool:
        """Whether ``seconds`` of caller audio fit the burst allowance; reports and enforces backpressure (a client
        over it is told once, and ended if it goes on)."""
        verdict = self._budget.admit(seconds, time.monotonic())
        if verdict is InputVerdict.DROP_AND_WARN:
            self.emit(self.codec.error_event("input_backpressure", self._budget.message()))
        elif verdict is InputVerdict.CLOSE:
            self.on_backpressure_close()
        return verdict is InputVerdict.ADMIT

    def on_backpressure_close(self) -> None:
        """The client went on sending faster than real time after its warning: the session ends (1013)."""
        self.spawn(self.abort("input_backpressure", self._budget.message(), close_code=CLOSE_TRY_AGAIN))

    # --- the engine session -----------------------------------------------------------------------------------
    async def open_engine(self, cfg: p.SessionConfig) -> EngineSession:
        """Open the engine session (``NEW -> OPENING``); raises :class:`WireError` when the engine refuses it (the
        session stays ``OPENING``: its caller ends it). The clocks start with :meth:`activate`."""
        self.advance(SessionState.OPENING)
        engine = await self.hub.open_engine_session(cfg, session_id=self.id)
        self.engine = engine
        self.bridge = SessionBridge(engine, self._on_engine_event)
        self.hub.add(self)
        return engine

    def activate(self) -> None:
        """``OPENING -> ACTIVE``: the engine session's events flow and the session's clocks start."""
        assert self.bridge is not None
        self.advance(SessionState.ACTIVE)
        self.started_at = time.monotonic()
        self._budget.reset(self.started_at)
        self.metrics.sessions_total.labels(transport=self.metrics_label).inc()
        self.metrics.active_sessions.labels(transport=self.metrics_label).inc()
        self.bridge.start()
        self.spawn(self._housekeeping())

    def _on_engine_event(self, ev: p.SessionEvent) -> None:
        """One engine event, from the bridge's pump (model text has already gone to the player)."""
        if self._state.ending:
            return  # the end is under way; the bridge stops when it completes
        match ev:
            case p.SessionClosed():
                self.spawn(self._engine_closed(ev.reason))
                return
            case p.SessionError(fatal=True):
                self._fatal = ev  # the engine closes the session next; the close reports it
                return
            case p.SessionError():
                self.emit(self.codec.error_event(ev.code, ev.message, type=SERVER_ERROR))
                return
            case p.BargeIn():
                self.metrics.barge_ins.inc()
            case p.Usage():
                self.context = (ev.context_tokens, ev.context_limit)
        self.on_engine_event(ev)

    async def _engine_closed(self, reason: p.CloseReason) -> None:
        fatal = self._fatal
        if reason is p.CloseReason.ENGINE_LOST or (
            fatal is not None and fatal.code == p.ErrorCode.ENGINE_LOST
        ):
            code, message = (
                "engine_lost",
                "the engine stopped; this session cannot continue (a new one can start)",
            )
        elif fatal is not None:
            code, message = fatal.code, fatal.message
        else:
            code, message = "session_ended", f"the engine ended the session ({reason})"
        await self.abort(code, message, close_code=CLOSE_INTERNAL)

    # --- housekeeping -----------------------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        deadline = self.started_at + self.settings.limits.session_lifetime_s
        while self._state is SessionState.ACTIVE:
            now = time.monotonic()
            if now >= deadline:
                await self.expire()
                return
            self.on_housekeeping(now)
            await asyncio.sleep(min(1.0, max(0.01, deadline - time.monotonic())))

    # --- the end ----------------------------------------------------------------------------------------------
    async def end(
        self,
        *,
        code: int,
        reason: str = "",
        notify: bool = True,
        error: Event | None = None,
        engine_reason: p.CloseReason = p.CloseReason.CLIENT,
    ) -> None:
        """End the session once: the dialect's last events (``notify=False``: the client is gone, nothing is sent),
        then the transport closes with ``code``, then the engine session (``engine_reason``)."""
        if self._state.ending:
            return
        was_active = self._state is SessionState.ACTIVE
        self.advance(SessionState.CLOSING)
        self.hub.discard(self)
        current = asyncio.current_task()
        for t in list(self._tasks):
            if t is not current:
                t.cancel()
        if notify:
            self.farewell(was_active=was_active, error=error)
        if was_active:
            self.metrics.active_sessions.labels(transport=self.metrics_label).dec()
        await self.transport.close(code, reason)
        self.advance(SessionState.CLOSED)
        # The bridge stops touching the rings before the engine session releases them.
        if self.bridge is not None:
            await self.bridge.close(engine_reason)
        elif self.engine is not None:
            await self.engine.close(engine_reason)
        log.info("%s session %s ended: %s (close %d)", self.dialect, self.id, reason or "client gone", code)

    async def abort(self, code: str, message: str, *, close_code: int) -> None:
        """End the session with an ``error`` (type ``server_error``) and close ``close_code``."""
        await self.end(
            code=close_code, reason=code, error=self.codec.error_event(code, message, type=SERVER_ERROR)
        )

    async def transport_closed(self) -> None:
        """The client went away (socket closed, peer failed): release everything, send nothing."""
        await self.end(code=CLOSE_NORMAL, notify=False)
