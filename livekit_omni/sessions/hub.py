"""The serving process's sessions in one place: admission to the engine, the open sessions, and the 20 ms output clock.

One :class:`SessionHub` per app (:func:`hub_of`). Every way in reaches the engine through it: the dialect sessions
open their engine sessions with :meth:`SessionHub.open_engine_session` (refusals become the error codes a client's
retry policy keys on, counted in ``rejected_sessions``), and chat completions start their text requests with
:meth:`SessionHub.start_text`. The hub also holds what outlives one connection: the resume tokens and the detached
sessions, the loss counters of ended sessions, and graceful shutdown.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from engine_bridge import protocol as p
from engine_bridge.client import EngineSession, TextStream
from engine_bridge.control import ControlError, EngineRequestError
from livekit_omni.sessions.errors import SERVER_ERROR, WireError
from livekit_omni.sessions.resume import ResumeTokens
from livekit_omni.sessions.transport import CLOSE_INTERNAL, CLOSE_RESTART
from livekit_omni.supervisor import EngineUnavailableError
from media.bridge import SessionBridge
from media.pacer import Pacer

if TYPE_CHECKING:
    from livekit_omni.drain import Drain
    from livekit_omni.metrics import Metrics
    from livekit_omni.settings import Settings
    from livekit_omni.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

#: Engine refusals of a new session that tell the client to try again (close 1013, HTTP 503/429).
TRY_AGAIN_CODES = frozenset({"session_limit_reached", "engine_unavailable"})


class HubSession(Protocol):
    """What the hub needs of a session, whichever dialect it speaks."""

    id: str
    #: The engine session's media (None until the engine session is open): its loss counters go to /metrics.
    bridge: SessionBridge | None

    def tick(self) -> None:
        """Produce one 20 ms output frame (WebSocket sessions, from the hub's clock)."""

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    async def abort(self, code: str, message: str, *, close_code: int) -> None:
        """End the session with an ``error`` (type ``server_error``) and close ``close_code``."""

    async def end(self, *, code: int, reason: str = "", notify: bool = True) -> None:
        """End the session once; ``notify=False``: the client is gone, nothing is sent."""


class HeldSessions:
    """The number of sessions a :class:`SessionHub` holds, as a drain counts them (:meth:`SessionHub.held`)."""

    def __init__(self, hub: SessionHub) -> None:
        self.hub = hub

    def __len__(self) -> int:
        return len(self.hub.sessions) + self.hub.opening


class SessionHub:
    """Open sessions of every dialect (for metrics and graceful shutdown), admission to the engine, and the shared
    20 ms output clock, so a thousand WebSocket sessions cost one timer, not a thousand."""

    def __init__(self, settings: Settings, supervisor: EngineSupervisor, metrics: Metrics) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.metrics = metrics
        self.sessions: set[HubSession] = set()
        #: Sessions whose engine session is being opened (admitted, not yet in ``sessions``).
        self.opening = 0
        self._ticking: dict[HubSession, None] = {}  # insertion-ordered set
        self._clock_task: asyncio.Task[None] | None = None
        #: The shared output clock while it runs (its ``late``/``skipped`` counters show a loop that fell behind).
        self.pacer: Pacer | None = None
        #: Resume tokens (livekit_omni.sessions.resume), and the sessions now detached, waiting for a resume.
        self.resume_tokens: ResumeTokens[HubSession] = ResumeTokens()
        self.detached: set[HubSession] = set()
        #: The server's admission state (a draining server keeps no session for resume).
        self.drain: Drain | None = None
        #: Loss counters (metrics.MEDIA_LOSS_KEYS) of the sessions that have ended, and of events dropped by
        #: the sessions themselves; /metrics adds the open sessions' counters at scrape time.
        self.losses: collections.Counter[str] = collections.Counter()
        metrics.media_losses.source = self.loss_totals

    @property
    def admitting(self) -> bool:
        return self.drain is None or self.drain.admitting

    # --- the engine -------------------------------------------------------------------------------------------
    async def open_engine_session(self, cfg: p.SessionConfig, *, session_id: str) -> EngineSession:
        """Open one engine session for a session of any dialect; refusals become a :class:`WireError` with the code
        a client's retry policy keys on (``session_limit_reached`` and ``engine_unavailable``: try again, close
        1013), and are counted in ``rejected_sessions``."""
        limits = self.settings.limits

        def refused(code: str, message: str) -> WireError:
            self.metrics.rejected_sessions.labels(reason=code).inc()
            return WireError(code, message, type=SERVER_ERROR)

        self.opening += 1
        try:
            return await self.supervisor.open_session(
                cfg, session_id=session_id, ingress_seconds=max(4.0, limits.input_burst_s + 1.0)
            )
        except EngineUnavailableError as e:
            raise refused(
                "engine_unavailable", f"the engine is not available ({e}); try again shortly"
            ) from e
        except EngineRequestError as e:
            if e.code == p.ErrorCode.SESSION_LIMIT_REACHED:
                raise refused("session_limit_reached", e.message) from e
            if e.code == p.ErrorCode.ENGINE_LOADING:
                raise refused("engine_unavailable", e.message) from e
            raise refused("engine_error", f"the engine refused the session: {e.message}") from e
        except (ControlError, TimeoutError) as e:
            raise refused("engine_unavailable", f"the engine did not answer: {e}") from e
        finally:
            # The caller adds an opened session to ``sessions`` with no await in between, so a drain always
            # counts it in one of the two.
            self.opening -= 1

    async def start_text(
        self,
        messages: list[p.TextMessage],
        sampling: p.TextSampling,
        *,
        tools: list[p.ToolDef] | None = None,
        tool_choice: p.ToolChoiceSpec | None = None,
    ) -> TextStream:
        """Start one text request (chat completions) on the engine's thinker, with the function ``tools`` its reply
        may call. Raises :class:`~livekit_omni.supervisor.EngineUnavailableError` when no ready engine is attached,
        and the engine client's errors (``EngineRequestError``, ``EngineLostError``, ``RequestTimeout``) as they
        come."""
        client = self.supervisor.ready_client()
        return await client.start_text(messages, sampling, tools=tools, tool_choice=tool_choice)

    # --- the open sessions ------------------------------------------------------------------------------------
    def add(self, s: HubSession) -> None:
        self.sessions.add(s)

    def discard(self, s: HubSession) -> None:
        if s in self.sessions and s.bridge is not None:
            self.losses.update(s.bridge.loss_counters())  # before the bridge releases the rings
        self.sessions.discard(s)
        self._ticking.pop(s, None)
        self.detached.discard(s)

    @property
    def held(self) -> HeldSessions:
        """What a drain waits for: the open sessions and those being opened (a SIGTERM while a call is being
        answered must not shut the server down under it)."""
        return HeldSessions(self)

    def loss_totals(self) -> dict[str, int]:
        totals = collections.Counter(self.losses)
        for s in self.sessions:
            if s.bridge is not None:
                totals.update(s.bridge.loss_counters())
        return dict(totals)

    def start_ticking(self, s: HubSession) -> None:
        self._ticking[s] = None
        if self._clock_task is None or self._clock_task.done():
            self._clock_task = asyncio.create_task(self._clock(), name="session-output-clock")

    async def _clock(self) -> None:
        self.pacer = pacer = Pacer()
        while self._ticking:
            await pacer.tick()
            for s in list(self._ticking):
                try:
                    s.tick()
                except Exception:
                    log.exception("session %s: output tick failed; closing it", s.id)
                    self._ticking.pop(s, None)
                    s.spawn(s.abort("internal_error", "output failed", close_code=CLOSE_INTERNAL))

    # --- shutdown and drain -----------------------------------------------------------------------------------
    async def end_detached(self) -> None:
        """The drain began: sessions without a client end now (nobody is there to finish them)."""
        sessions = list(self.detached)
        if sessions:
            self.metrics.detached_sessions_ended.labels(reason="drain").inc(len(sessions))
        await asyncio.gather(
            *(s.end(code=CLOSE_RESTART, notify=False) for s in sessions), return_exceptions=True
        )

    async def close_all(self) -> None:
        """Graceful shutdown: every open session gets an error and its dialect's last events, then close 1012."""
        sessions = list(self.sessions)
        await asyncio.gather(
            *(
                s.abort("server_shutdown", "the server is shutting down", close_code=CLOSE_RESTART)
                for s in sessions
            ),
            return_exceptions=True,
        )


def hub_of(app: Any) -> SessionHub:
    """The app's :class:`SessionHub`, created on first use; it also provides ``app.state.close_sessions``, which the
    app's lifespan awaits at shutdown."""
    hub: SessionHub | None = getattr(app.state, "session_hub", None)
    if hub is None:
        hub = SessionHub(app.state.settings, app.state.supervisor, app.state.metrics)
        hub.drain = getattr(app.state, "drain", None)
        app.state.session_hub = hub
        app.state.close_sessions = hub.close_all
    return hub
