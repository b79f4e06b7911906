"""One OpenAI Live session, translated to one engine session. Shared by the WebSocket and the WebRTC data channel.

The translation is thin on purpose: turn-taking, replies, barge-in and the conversation live in the engine; the
media plane (``media``) converts audio and paces output. This class maps wire commands to engine commands
(``AppendText``, ``SetMute``, ``Interrupt``), engine events to wire events (transcripts, errors, close), and keeps
the protocol's own bookkeeping: lifetime, usage, input backpressure, fixtures, and the order of events.

Who runs what (all on the event loop, never blocking it):

* the transport's receive loop calls :meth:`LiveSession.handle_text` for each client message, in order;
* the session's :class:`~media.bridge.SessionBridge` owns its ingress writer, egress player, engine event pump
  (which calls :meth:`LiveSession._on_engine_event`) and engine keep-alive, as for every consumer of an engine
  session (the WebRTC peer uses the bridge's writer and player);
* one task per session does the 1 s housekeeping (lifetime, usage);
* :class:`LiveHub` ticks every WebSocket session's output once per 20 ms from one shared clock, so a thousand
  sessions cost one timer, not a thousand.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgspec
import numpy as np

from engine_bridge import protocol as p
from engine_bridge.client import EngineSession
from engine_bridge.control import ControlError, EngineLostError, EngineRequestError
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, FRAME_MS
from livekit_omni import worker_ids
from livekit_omni.live import wire
from livekit_omni.live.backpressure import InputBudget, InputVerdict
from livekit_omni.sessions.eventlog import event_log
from livekit_omni.live.resume import TRANSPORT_MISMATCH, DetachedTransport, ResumeTokens
from livekit_omni.live.turn_latency import TurnLatencyClock
from livekit_omni.supervisor import EngineUnavailableError
from media.bridge import SessionBridge
from media.codecs import AudioEncoding, alaw_encode, ulaw_encode
from media.egress import EgressPlayer, OutputFrame, TranscriptDelta
from media.ingress import IngressWriter
from media.pacer import Pacer
from media.resample import Resampler

if TYPE_CHECKING:
    from livekit_omni.drain import Drain
    from livekit_omni.metrics import Metrics
    from livekit_omni.settings import Settings
    from livekit_omni.supervisor import EngineSupervisor

log = logging.getLogger(__name__)

# WebSocket close codes (RFC 6455): what a client's reconnect policy keys on (docs/protocol.md).
CLOSE_NORMAL: Final = 1000
CLOSE_POLICY: Final = 1008
CLOSE_INTERNAL: Final = 1011
CLOSE_RESTART: Final = 1012
CLOSE_TRY_AGAIN: Final = 1013

#: Cumulative ``session.usage.updated`` cadence.
USAGE_INTERVAL_S: Final = 5.0
#: Output audio is sent in chunks of this many 20 ms frames while the model speaks (40 ms: a small lead for
#: barge-in, half the messages of 20 ms) and of ``SILENCE_CHUNK_FRAMES`` while it is silent (100 ms: the largest
#: chunk the protocol recommends; silence costs a fifth of the messages). A frame with model audio flushes pending
#: silence at once, so speech is never held behind silence.
SPEECH_CHUNK_FRAMES: Final = 2
SILENCE_CHUNK_FRAMES: Final = 5
#: Commands to the engine that do not answer within this are reported as an error (the session goes on).
ENGINE_REQUEST_TIMEOUT_S: Final = 5.0
#: Transports whose sessions survive a dropped connection (``resume_grace_s``).
RESUMABLE_TRANSPORTS: Final = frozenset({"websocket", "webrtc"})


class Transport(Protocol):
    """How a session reaches its client. Events are encoded JSON objects; audio differs per transport."""

    #: Metrics label: ``websocket`` or ``webrtc``.
    kind: str
    #: True: output audio goes out as ``session.output_audio.delta`` events and input arrives as
    #: ``session.input_audio.append`` (WebSocket). False: both travel on a media track (WebRTC).
    carries_audio: bool

    def send(self, data: bytes) -> None:
        """Queue one encoded event; never blocks. A client that stops reading is disconnected by the transport."""

    async def put(self, data: bytes) -> None:
        """Queue one encoded event, waiting for room (a resumed session's backlog goes out through this)."""

    async def close(self, code: int, reason: str = "") -> None:
        """Flush queued events, then close with ``code``. Idempotent."""


class FixturePlayback:
    """A fixture clip (PCM16 24 kHz) resampled to an output rate, handed out in 20 ms frames."""

    def __init__(self, pcm: np.ndarray, *, rate: int, encoding: AudioEncoding) -> None:
        frame_in = ENGINE_OUTPUT_RATE * FRAME_MS // 1000
        # Whole frames plus one frame of zeros, which also flushes the resampler's delay line.
        padded = np.zeros(-(-pcm.shape[0] // frame_in) * frame_in + frame_in, dtype=np.int16)
        padded[: pcm.shape[0]] = pcm
        self.pcm = Resampler.for_rates(ENGINE_OUTPUT_RATE, rate).process(padded)
        self.encoding = encoding
        self.frame_samples = rate * FRAME_MS // 1000
        self.pos = 0
        self._frame = np.zeros(self.frame_samples, dtype=np.int16)

    @property
    def done(self) -> bool:
        return self.pos >= self.pcm.shape[0]

    def next_frame(self) -> tuple[np.ndarray, np.ndarray]:
        """The next 20 ms as (int16 pcm, payload bytes in the output encoding)."""
        chunk = self.pcm[self.pos : self.pos + self.frame_samples]
        self.pos += self.frame_samples
        pcm = self._frame
        pcm[: chunk.shape[0]] = chunk
        pcm[chunk.shape[0] :] = 0
        if self.encoding is AudioEncoding.PCMU:
            payload = ulaw_encode(pcm)
        elif self.encoding is AudioEncoding.PCMA:
            payload = alaw_encode(pcm)
        else:
            payload = pcm.astype("<i2", copy=False).view(np.uint8)
        return pcm, payload


class FixtureOverlay:
    """Wraps a session's :class:`EgressPlayer`: while a fixture plays, its frames replace the model's.

    The player keeps running underneath (it keeps the output timeline and drains the ring, whose audio is stale
    after the fixture's interrupt anyway). It stands in for the player wherever frames are pulled: the hub's clock
    (WebSocket) or the WebRTC track.
    """

    def __init__(self, player: EgressPlayer, on_fixture_done: Callable[[], None]) -> None:
        self.inner = player
        self.rate = player.rate
        self.frame_samples = player.frame_samples
        self.fixture: FixturePlayback | None = None
        self._on_done = on_fixture_done

    async def prepare(self, pcm24k: np.ndarray) -> FixturePlayback:
        """Resample the clip for this output, off the event loop (30 s at 48 kHz takes tens of ms)."""
        return await asyncio.to_thread(
            FixturePlayback, pcm24k, rate=self.inner.rate, encoding=self.inner.encoding
        )

    def play(self, fixture: FixturePlayback) -> None:
        self.fixture = fixture

    def add_transcript(self, ev: p.OutputTranscript) -> None:
        self.inner.add_transcript(ev)

    def next_frame(self) -> OutputFrame:
        frame = self.inner.next_frame()
        fixture = self.fixture
        if fixture is None:
            return frame
        pcm, payload = fixture.next_frame()
        if fixture.done:
            self.fixture = None
            self._on_done()
        # Model text released under a fixture belongs to interrupted (stale) speech: it is not shown.
        return msgspec.structs.replace(
            frame, pcm=pcm, payload=payload, speaking=True, model_samples=0, transcripts=()
        )


class HubSession(Protocol):
    """What the hub needs of a facade session, whichever dialect it speaks (Live or Realtime)."""

    id: str
    #: The engine session's media (None until the engine session is open): its loss counters go to /metrics.
    bridge: SessionBridge | None

    def tick(self) -> None:
        """Produce one 20 ms output frame (WebSocket sessions, from the hub's clock)."""

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]: ...

    async def abort(self, code: str, message: str, *, close_code: int) -> None:
        """End the session with an ``error`` (type ``server_error``) and close ``close_code``."""


class LiveHub:
    """The facade's shared state: open sessions of both dialects (for metrics and graceful shutdown) and the 20 ms
    output clock."""

    def __init__(self, settings: Settings, supervisor: EngineSupervisor, metrics: Metrics) -> None:
        self.settings = settings
        self.supervisor = supervisor
        self.metrics = metrics
        self.sessions: set[HubSession] = set()
        self._ticking: dict[HubSession, None] = {}  # insertion-ordered set
        self._clock_task: asyncio.Task[None] | None = None
        #: The shared output clock while it runs (its ``late``/``skipped`` counters show a loop that fell behind).
        self.pacer: Pacer | None = None
        #: Resume tokens of the Live sessions (livekit_omni.live.resume), and the sessions now detached.
        self.resume_tokens: ResumeTokens[LiveSession] = ResumeTokens()
        self.detached: set[LiveSession] = set()
        #: The server's admission state (a draining server keeps no session for resume).
        self.drain: Drain | None = None
        #: Loss counters (metrics.MEDIA_LOSS_KEYS) of the sessions that have ended, and of events dropped by
        #: the facade itself; /metrics adds the open sessions' counters at scrape time.
        self.losses: collections.Counter[str] = collections.Counter()
        metrics.media_losses.source = self.loss_totals

    @property
    def admitting(self) -> bool:
        return self.drain is None or self.drain.admitting

    async def end_detached(self) -> None:
        """The drain began: sessions without a client end now (nobody is there to finish them)."""
        sessions = list(self.detached)
        if sessions:
            self.metrics.detached_sessions_ended.labels(reason="drain").inc(len(sessions))
        await asyncio.gather(
            *(s.end(None, code=CLOSE_RESTART, notify=False) for s in sessions), return_exceptions=True
        )

    def add(self, s: HubSession) -> None:
        self.sessions.add(s)

    def discard(self, s: HubSession) -> None:
        if s in self.sessions and s.bridge is not None:
            self.losses.update(s.bridge.loss_counters())  # before the bridge releases the rings
        self.sessions.discard(s)
        self._ticking.pop(s, None)

    def loss_totals(self) -> dict[str, int]:
        totals = collections.Counter(self.losses)
        for s in self.sessions:
            if s.bridge is not None:
                totals.update(s.bridge.loss_counters())
        return dict(totals)

    def start_ticking(self, s: HubSession) -> None:
        self._ticking[s] = None
        if self._clock_task is None or self._clock_task.done():
            self._clock_task = asyncio.create_task(self._clock(), name="live-output-clock")

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

    async def close_all(self) -> None:
        """Graceful shutdown: every open session gets an error and ``session.closed``, then close 1012."""
        sessions = list(self.sessions)
        await asyncio.gather(
            *(
                s.abort("server_shutdown", "the server is shutting down", close_code=CLOSE_RESTART)
                for s in sessions
            ),
            return_exceptions=True,
        )


async def open_engine_session(hub: LiveHub, cfg: p.SessionConfig, *, session_id: str) -> EngineSession:
    """Open one engine session for a facade session of either dialect; refusals become a :class:`WireError`
    with the code a client's retry policy keys on (``session_limit_reached`` and ``engine_unavailable``: try
    again, close 1013), and are counted in ``rejected_sessions``."""
    limits = hub.settings.limits

    def refused(code: str, message: str) -> wire.WireError:
        hub.metrics.rejected_sessions.labels(reason=code).inc()
        return wire.WireError(code, message, type=wire.SERVER_ERROR)

    try:
        return await hub.supervisor.open_session(
            cfg, session_id=session_id, ingress_seconds=max(4.0, limits.input_burst_s + 1.0)
        )
    except EngineUnavailableError as e:
        raise refused("engine_unavailable", f"the engine is not available ({e}); try again shortly") from e
    except EngineRequestError as e:
        if e.code == p.ErrorCode.SESSION_LIMIT_REACHED:
            raise refused("session_limit_reached", e.message) from e
        if e.code == p.ErrorCode.ENGINE_LOADING:
            raise refused("engine_unavailable", e.message) from e
        raise refused("engine_error", f"the engine refused the session: {e.message}") from e
    except (ControlError, TimeoutError) as e:
        raise refused("engine_unavailable", f"the engine did not answer: {e}") from e


def hub_of(app: Any) -> LiveHub:
    """The app's :class:`LiveHub`, created on first use; it also provides ``app.state.close_sessions``, which the
    app's lifespan awaits at shutdown."""
    hub: LiveHub | None = getattr(app.state, "live_hub", None)
    if hub is None:
        hub = LiveHub(app.state.settings, app.state.supervisor, app.state.metrics)
        hub.drain = getattr(app.state, "drain", None)
        app.state.live_hub = hub
        app.state.close_sessions = hub.close_all
    return hub


class LiveSession:
    """One Live session over one transport. See the module docstring."""

    def __init__(self, hub: LiveHub, transport: Transport, *, accepts_start: bool = True) -> None:
        self.hub = hub
        self.transport = transport
        self.settings = hub.settings
        self.metrics = hub.metrics
        self.accepts_start = accepts_start
        self.id = "live_" + worker_ids.tagged(secrets.token_hex(12))
        self.state = "new"  # new -> opening -> active -> closed
        self.config: wire.ResolvedConfig | None = None
        self.engine: EngineSession | None = None
        #: The engine session's media, event pump and keep-alive (made when the engine session opens).
        self.bridge: SessionBridge | None = None
        self.player: EgressPlayer | None = None
        #: Where output frames are pulled from: the player with fixture overlay.
        self.output: FixtureOverlay | None = None
        self.writer: IngressWriter | None = None
        self.expires_at = 0
        self.started_at = 0.0
        self.allowed_client_events: frozenset[str] | None = None
        self.allowed_server_events: frozenset[str] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._log = event_log("live")
        # Mute as the client asked for it; the engine is also muted while a fixture plays.
        self.user_muted = False
        self._fixture_playing = False
        self._fixture_client_event_id: str | None = None
        # Output chunking (WebSocket).
        self._out = bytearray()
        self._out_frames = 0
        self._out_speaking = False
        # Input backpressure (livekit_omni.live.backpressure).
        limits = self.settings.limits
        self._budget = InputBudget(
            burst_s=limits.input_burst_s, grace_s=limits.input_backpressure_grace_s, now=time.monotonic()
        )
        self._last_input = 0.0
        # The ingress writer's overrun and dropped-sample counts already added to the metrics.
        self._overruns_counted = 0
        self._dropped_counted = 0
        # Timeline bookkeeping: input transcripts are kept non-decreasing.
        self._last_input_ms = 0
        self._last_output_ms = 0
        self._turn_latency = TurnLatencyClock()
        self._context: tuple[int, int] | None = None
        self._fatal: p.SessionError | None = None
        # Resume (livekit_omni.live.resume): the token of the last session.started; while detached (and while a
        # resumed client is sent the backlog) the buffer that stands in for the transport.
        self.resume_token: str | None = None
        self._detached: DetachedTransport | None = None
        self._replaying_to: Transport | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._grace_task: asyncio.Task[None] | None = None
        #: A connection's first session: set when its ``session.resume`` took over an existing session instead.
        self.successor: LiveSession | None = None

    # --- small helpers --------------------------------------------------------------------------------------
    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def emit(self, ev: wire.ServerEvent) -> None:
        """Send one server event."""
        etype = wire.event_type(ev)
        if self.allowed_server_events is not None and etype not in self.allowed_server_events:
            return
        data = wire.encode(ev)
        if len(data) > self.settings.limits.max_outbound_bytes:
            data = self._shrink(ev, etype, data)
        if isinstance(ev, wire.Error):
            self.metrics.errors.labels(code=ev.error.code).inc()
        self._send(data)

    def _send(self, data: bytes) -> None:
        """Every frame leaves through here, so the event log holds exactly what crossed the wire."""
        if self._log is not None:
            self._log.write(data)
        self.transport.send(data)

    def _shrink(self, ev: wire.ServerEvent, etype: str, data: bytes) -> bytes:
        """An event over ``max_outbound_bytes`` (clients break on large frames): the session resource loses its
        echo-only history and instructions; anything else still too large is replaced by an error."""
        if isinstance(ev, wire.SessionStarted | wire.SessionUpdated | wire.SessionClosed):
            slim = msgspec.structs.replace(ev.session, input=None, instructions=None)
            data = wire.encode(msgspec.structs.replace(ev, session=slim))
        if len(data) > self.settings.limits.max_outbound_bytes:
            log.error(
                "session %s: dropped a %d-byte %s event (over the outbound limit)", self.id, len(data), etype
            )
            self.hub.losses["events_too_large"] += 1
            data = wire.encode(
                wire.error_event(
                    "event_too_large", f"a {etype} event was too large to send", type=wire.SERVER_ERROR
                )
            )
        return data

    def emit_error(self, e: wire.WireError, client_event_id: str | None = None) -> None:
        self.emit(wire.error_from(e, client_event_id))

    def resource(self) -> wire.SessionResource:
        assert self.config is not None
        caps = self.hub.supervisor.engine_info.get("capabilities")
        return wire.session_resource(
            self.config,
            session_id=self.id,
            expires_at=self.expires_at,
            capabilities=caps if isinstance(caps, dict) else None,
        )

    def usage_seconds(self) -> float:
        return round(time.monotonic() - self.started_at, 1) if self.started_at else 0.0

    # --- receive path ---------------------------------------------------------------------------------------
    async def handle_text(self, raw: str | bytes) -> None:
        """One client message. Errors become ``error`` events; the session goes on whenever it can."""
        if self.state == "closed":
            return
        try:
            cmd = wire.decode_command(raw)
        except wire.WireError as e:
            self.emit_error(e)
            return
        cid = cmd.event_id
        ctype = wire.event_type(cmd)
        if self.allowed_client_events is not None and ctype not in self.allowed_client_events:
            self.emit(
                wire.error_event(
                    "event_not_allowed",
                    f"{ctype} is not allowed on this data channel (session.client.data_channel)",
                    param="type",
                    client_event_id=cid,
                )
            )
            return
        if isinstance(cmd, wire.SessionStart):
            await self._on_start(cmd)
            return
        if isinstance(cmd, wire.SessionResume):
            await self._on_resume(cmd)
            return
        if self.state != "active":
            self.emit(
                wire.error_event(
                    "session_not_started",
                    f"send session.start and wait for session.started before {ctype}",
                    param="type",
                    client_event_id=cid,
                )
            )
            return
        try:
            await self._dispatch(cmd)
        except wire.WireError as e:
            self.emit_error(e, cid)
        except (EngineLostError, EngineRequestError, ControlError, TimeoutError) as e:
            # The engine-event pump ends the session if the engine is gone; a single failed command is not fatal.
            self.emit(
                wire.error_event(
                    "engine_error",
                    f"the engine did not complete {ctype}: {e}",
                    type=wire.SERVER_ERROR,
                    client_event_id=cid,
                )
            )

    async def _dispatch(self, cmd: wire.ClientCommand) -> None:
        cid = cmd.event_id
        match cmd:
            case wire.InputAudioAppend():
                self._on_audio(cmd)
            case wire.InputAudioMute() | wire.InputAudioUnmute():
                muted = isinstance(cmd, wire.InputAudioMute)
                self.user_muted = muted
                if not self._fixture_playing:  # a fixture keeps the input muted until it ends
                    await self._set_engine_mute(muted)
                self.emit(
                    wire.InputAudioMuted(client_event_id=cid)
                    if muted
                    else wire.InputAudioUnmuted(client_event_id=cid)
                )
            case wire.InstructionsAppend() | wire.ThinkingAppend() | wire.CommentaryAppend():
                await self._on_append(cmd)
            case wire.FixturePlay():
                await self._on_fixture(cmd)
            case wire.SessionUpdate():
                assert self.config is not None
                delegation = wire.check_update(cmd.session, self.config.delegation)
                if delegation is not None:
                    self.config.delegation = delegation
                self.emit(wire.SessionUpdated(client_event_id=cid, session=self.resource()))
            case wire.SessionClose():
                await self.end("close_requested", code=CLOSE_NORMAL, client_event_id=cid)
            case _:
                raise wire.WireError("unknown_event", f"unhandled event {type(cmd).__name__}")

    # --- session.start --------------------------------------------------------------------------------------
    async def _on_start(self, cmd: wire.SessionStart) -> None:
        cid = cmd.event_id
        if not self.accepts_start:
            self.emit(
                wire.error_event(
                    "session_already_started",
                    "this session was started by the WebRTC offer; session.start is not used on the data channel",
                    param="type",
                    client_event_id=cid,
                )
            )
            return
        if self.state != "new":
            self.emit(
                wire.error_event(
                    "session_already_started",
                    "session.start was already sent on this connection",
                    param="type",
                    client_event_id=cid,
                )
            )
            return
        try:
            cfg = wire.resolve_config(cmd.session, with_format=True)
        except wire.WireError as e:
            # A refused start ends the connection: LiveKit would otherwise wait for session.started forever.
            self.state = "closed"
            self.metrics.rejected_sessions.labels(reason=e.code).inc()
            self.emit_error(e, cid)
            await self.transport.close(CLOSE_POLICY, e.code)
            return
        if await self.open(cfg, client_event_id=cid):
            self.announce(client_event_id=cid)

    async def open(self, cfg: wire.ResolvedConfig, *, client_event_id: str | None = None) -> bool:
        """Open the engine session for ``cfg``. On refusal: an ``error`` event, a close, and False.

        (WebRTC calls this before answering the offer and reports refusals as HTTP errors instead; see
        :meth:`open_or_raise`.)"""
        try:
            await self.open_or_raise(cfg)
        except wire.WireError as e:
            self.emit_error(e, client_event_id)
            code = (
                CLOSE_TRY_AGAIN
                if e.code in ("session_limit_reached", "engine_unavailable")
                else CLOSE_INTERNAL
            )
            await self.transport.close(code, e.code)
            return False
        return True

    async def open_or_raise(self, cfg: wire.ResolvedConfig) -> None:
        """Open the engine session; raises WireError (``session_limit_reached``, ``engine_unavailable``, …)."""
        self.state = "opening"
        self.config = cfg
        engine_cfg = p.SessionConfig(
            instructions=cfg.instructions,
            history=[p.ChatTurn(role=r, text=t) for r, t in cfg.history],  # type: ignore[arg-type]
            voice=cfg.voice_name,
        )
        try:
            self.engine = await open_engine_session(self.hub, engine_cfg, session_id=self.id)
        except wire.WireError:
            self.state = "closed"
            raise
        self.bridge = SessionBridge(self.engine, self._on_engine_event)
        self.hub.add(self)

    def announce(self, *, client_event_id: str | None = None) -> None:
        """Send ``session.started`` and start the session's clocks (after the engine session is open)."""
        assert self.bridge is not None and self.config is not None
        self.state = "active"
        self.started_at = time.monotonic()
        self._last_input = self.started_at
        self._budget.reset(self.started_at)
        self.expires_at = int(time.time() + self.settings.limits.session_lifetime_s)
        self.metrics.sessions_total.labels(transport=self.transport.kind).inc()
        self.metrics.active_sessions.labels(transport=self.transport.kind).inc()
        if self.transport.carries_audio and self.config.format is not None:
            fmt = self.config.format
            self.writer = self.bridge.writer
            self.writer.set_format(fmt.encoding, fmt.rate)
            self.attach_player(self.bridge.open_output(rate=fmt.rate, encoding=fmt.encoding))
        if self.resumable:
            self.resume_token = self.hub.resume_tokens.issue(self)
        self.emit(
            wire.SessionStarted(
                client_event_id=client_event_id, session=self.resource(), resume_token=self.resume_token
            )
        )
        if self.config.store_requested:
            self.emit(
                wire.Info(
                    code="store_unavailable",
                    message="this server does not store sessions (no fork or recording download); store is ignored",
                )
            )
        self.bridge.start()
        self.spawn(self._housekeeping())
        if self.transport.carries_audio and self.output is not None:
            self.hub.start_ticking(self)

    def attach_player(self, player: EgressPlayer) -> FixtureOverlay:
        """Use ``player`` for output (model text goes to it); returns the overlay to pull frames from."""
        self.player = player
        self.output = FixtureOverlay(player, self._on_fixture_done)
        return self.output

    # --- resume (livekit_omni.live.resume) -------------------------------------------------------------------
    @property
    def resumable(self) -> bool:
        """Whether a dropped connection detaches this session instead of ending it."""
        return self.settings.resume_grace_s > 0 and self.transport.kind in RESUMABLE_TRANSPORTS

    @property
    def detached(self) -> bool:
        """No client is connected (the session waits for a resume); also False while a backlog is replayed."""
        return self._detached is not None and self._replaying_to is None

    async def _on_resume(self, cmd: wire.SessionResume) -> None:
        """``session.resume`` as a connection's first command: hand this connection to the token's session."""
        cid = cmd.event_id
        if not self.accepts_start or self.state != "new":
            self.emit(
                wire.error_event(
                    "session_already_started",
                    "session.resume is only accepted as the first command of a connection",
                    param="type",
                    client_event_id=cid,
                )
            )
            return
        tokens = self.hub.resume_tokens
        target = tokens.peek(cmd.resume_token)
        try:
            if target is not None and target.transport.kind != self.transport.kind:
                raise wire.WireError(
                    TRANSPORT_MISMATCH,
                    f"this token resumes a {target.transport.kind} session; resume it there",
                    param="resume_token",
                )
            target = tokens.take(cmd.resume_token)
        except wire.WireError as e:
            # The connection stays usable: the client may start a new session on it.
            self.metrics.resume_refused.labels(code=e.code).inc()
            self.emit_error(e, cid)
            return
        self.state = "closed"
        self.successor = target
        await target.attach(self.transport, client_event_id=cid)

    def _new_buffer(self, kind: str) -> DetachedTransport:
        limits = self.settings.limits
        return DetachedTransport(
            kind=kind,
            carries_audio=self.transport.carries_audio,
            max_events=limits.resume_buffer_events,
            max_bytes=limits.resume_buffer_bytes,
            on_overflow=self._on_buffer_overflow,
        )

    def _on_buffer_overflow(self) -> None:
        log.warning("session %s: detached output over the resume buffer; closing the session", self.id)
        self.metrics.detached_sessions_ended.labels(reason="overflow").inc()
        self.spawn(self.end(None, code=CLOSE_NORMAL, notify=False))

    async def transport_lost(self, transport: Transport, *, may_detach: bool = True) -> None:
        """``transport`` dropped without ``session.close``: detach for a resume when allowed (``may_detach``, the
        session resumable, the server not draining), else end."""
        if self.state == "closed":
            return
        if transport is not self.transport and transport is not self._replaying_to:
            return  # a connection this session has already left (a resume took it over)
        if not may_detach or self.state != "active" or not self.resumable or not self.hub.admitting:
            await self.transport_closed()
            return
        self._detach()

    def _detach(self) -> None:
        if self._replaying_to is not None:
            # Dropped again while the backlog was being sent: the rest of it stays in the buffer.
            self._replaying_to = None
            if self._replay_task is not None:
                self._replay_task.cancel()
                self._replay_task = None
        else:
            self._detached = self._new_buffer(self.transport.kind)
            self.transport = self._detached
        self.hub.detached.add(self)
        self.metrics.sessions_detached.inc()
        grace = self.settings.resume_grace_s
        log.info("session %s: connection lost; kept %g s for a resume", self.id, grace)
        self._grace_task = self.spawn(self._grace_expiry(grace))

    async def _grace_expiry(self, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        if self.detached:
            log.info("session %s: not resumed within %g s; closing it", self.id, grace_s)
            self.metrics.detached_sessions_ended.labels(reason="expired").inc()
            await self.end(None, code=CLOSE_NORMAL, notify=False)

    async def attach(self, transport: Transport, *, client_event_id: str | None = None) -> None:
        """A resume: ``transport`` takes this session over (its token already spent). It gets ``session.started``
        (same id, a fresh token), then what was kept while detached, then the session as it goes on."""
        if self._grace_task is not None:
            self._grace_task.cancel()
            self._grace_task = None
        previous: Transport | None = None
        if self._detached is None:
            # The old connection is still open here (it has not noticed it is gone): it is closed, and its
            # output from now on is kept for the new one.
            previous = self.transport
            self._detached = self._new_buffer(self.transport.kind)
            self.transport = self._detached
        elif self._replaying_to is not None:
            previous = self._replaying_to
            self._replaying_to = None
            if self._replay_task is not None:
                self._replay_task.cancel()
                self._replay_task = None
        self.hub.detached.discard(self)
        buffer = self._detached
        self._replaying_to = transport
        if previous is not None:
            await previous.close(CLOSE_NORMAL, "session_resumed")
        if self.state != "active" or self._replaying_to is not transport:
            await transport.close(CLOSE_NORMAL, "session_ended")
            return
        now = time.monotonic()
        self._last_input = now
        self._budget.reset(now)  # the new client's audio starts now; the gap is not a burst
        self.resume_token = self.hub.resume_tokens.issue(self)
        started = wire.encode(
            wire.SessionStarted(
                client_event_id=client_event_id, session=self.resource(), resume_token=self.resume_token
            )
        )
        if self._log is not None:
            self._log.write(started)
        transport.send(started)
        self.metrics.sessions_resumed.inc()
        log.info("session %s: resumed (%d events kept)", self.id, len(buffer.pending))
        self._replay_task = self.spawn(self._replay(buffer, transport))

    async def _replay(self, buffer: DetachedTransport, transport: Transport) -> None:
        """Send the backlog at the pace the connection takes it; once it is empty, events go straight out."""
        while buffer.pending:
            await transport.put(buffer.pop())
        if self._replaying_to is transport and self.state == "active":
            self.transport = transport
            self._detached = None
            self._replaying_to = None
            self._replay_task = None

    # --- input audio ----------------------------------------------------------------------------------------
    def _on_audio(self, cmd: wire.InputAudioAppend) -> None:
        if not self.transport.carries_audio or self.writer is None or self.config is None:
            raise wire.WireError(
                "unsupported_event",
                "on WebRTC, caller audio travels on the media track, not in session.input_audio.append",
                param="type",
            )
        fmt = self.config.format
        assert fmt is not None
        raw = wire.decode_audio(cmd.audio, fmt)
        seconds = len(raw) / fmt.bytes_per_sample / fmt.rate
        now = time.monotonic()
        self._last_input = now
        if not self._admit_input(seconds, now):
            return  # beyond the burst allowance: dropped, never queued
        self.writer.write(raw)  # also rings the engine's doorbell
        self.metrics.audio_in_seconds.inc(seconds)
        self.count_ingress_drops()

    def count_ingress_drops(self) -> None:
        """Add caller audio the ingress ring refused since the last call to the metrics. The ring never overwrites:
        when the engine falls behind (stalled, overloaded) the newest audio is dropped (media.ingress)."""
        writer = self.bridge.writer if self.bridge is not None else None
        if writer is None or writer.overruns == self._overruns_counted:
            return
        self.metrics.ingress_dropped_seconds.inc(
            (writer.samples_dropped - self._dropped_counted) / ENGINE_INPUT_RATE
        )
        self._overruns_counted, self._dropped_counted = writer.overruns, writer.samples_dropped

    def _admit_input(self, seconds: float, now: float) -> bool:
        """Whether ``seconds`` of caller audio fit the burst allowance; reports and enforces backpressure."""
        verdict = self._budget.admit(seconds, now)
        if verdict is InputVerdict.DROP_AND_WARN:
            self.emit(wire.error_event("input_backpressure", self._budget.message()))
        elif verdict is InputVerdict.CLOSE:
            # The client was told once; now the session ends.
            self.spawn(self.end("connection_lost", code=CLOSE_TRY_AGAIN, close_reason="input_backpressure"))
        return verdict is InputVerdict.ADMIT

    # --- appends, fixtures, mute ----------------------------------------------------------------------------
    async def _on_append(self, cmd: wire.TextAppend) -> None:
        assert self.engine is not None
        kind, ack = wire.APPEND_KINDS[type(cmd)]
        if self._fixture_playing:
            raise wire.WireError("fixture_active", "appends are refused while an audio fixture plays")
        if cmd.delegation_id is not None:
            raise wire.WireError(
                "unknown_delegation",
                f"no delegation {cmd.delegation_id!r} was created in this session",
                param="delegation_id",
            )
        if len(cmd.content) > wire.MAX_APPEND_CHARS:
            raise wire.WireError(
                "content_too_long",
                f"content is limited to {wire.MAX_APPEND_CHARS} characters",
                param="content",
            )
        landed = await self.engine.append_text(kind, cmd.content)
        start, end = landed.start_ms, max(landed.start_ms, landed.end_ms)
        self.emit(ack(client_event_id=cmd.event_id, start_ms=start, end_ms=end))

    async def _set_engine_mute(self, muted: bool) -> None:
        assert self.engine is not None
        await asyncio.wait_for(self.engine.set_mute(muted), ENGINE_REQUEST_TIMEOUT_S)

    async def _on_fixture(self, cmd: wire.FixturePlay) -> None:
        assert self.engine is not None
        raw = wire.decode_audio(cmd.audio, wire.FIXTURE_FORMAT)
        seconds = len(raw) / 2 / ENGINE_OUTPUT_RATE
        limit = self.settings.limits.max_fixture_s
        if not raw:
            raise wire.WireError("invalid_audio", "the fixture holds no audio", param="audio")
        if seconds > limit:
            raise wire.WireError(
                "fixture_too_long", f"the fixture is {seconds:.1f} s; at most {limit:g} s", param="audio"
            )
        if self._fixture_playing:
            raise wire.WireError("fixture_active", "another fixture is playing")
        if self.output is None:
            raise wire.WireError(
                "fixture_unavailable", "this session has no output audio to play a fixture on"
            )
        self._fixture_playing = True
        self._fixture_client_event_id = cmd.event_id
        try:
            fixture = await self.output.prepare(np.frombuffer(raw, dtype="<i2").astype(np.int16))
            # Model speech stops (the epoch moves, so queued model audio never plays) and the caller is not heard.
            await asyncio.wait_for(self.engine.interrupt(), ENGINE_REQUEST_TIMEOUT_S)
            if not self.user_muted:
                await self._set_engine_mute(True)
        except BaseException:
            self._fixture_playing = False
            raise
        if self.state != "active":
            return
        self.output.play(fixture)
        self.emit(wire.FixturePlaying(client_event_id=cmd.event_id))

    def _on_fixture_done(self) -> None:
        # Called from the frame that carried the clip's last samples (sync); the rest needs the engine.
        self.spawn(self._fixture_finished())

    async def _fixture_finished(self) -> None:
        self._flush_audio()  # the clip's last frames go out before its "played"
        cid = self._fixture_client_event_id
        try:
            if not self.user_muted and self.state == "active":
                await self._set_engine_mute(False)
        finally:
            self._fixture_playing = False
            self._fixture_client_event_id = None
        if self.state == "active":
            self.emit(wire.FixturePlayed(client_event_id=cid))

    # --- output (WebSocket): one 20 ms frame per tick of the hub's clock -------------------------------------
    def tick(self) -> None:
        output = self.output
        if output is None or self.state != "active":
            return
        frame = output.next_frame()
        speaking = frame.speaking
        if speaking:
            if not self._out_speaking:
                self._flush_audio()  # pending silence goes out now; speech is not held behind it
            self._on_model_audio(frame)
        self._out_speaking = speaking
        self._out += frame.payload.data
        self._out_frames += 1
        if frame.transcripts:
            self._flush_audio()  # text follows the audio it describes
            self._emit_output_transcripts(frame.transcripts)
        elif self._out_frames >= (SPEECH_CHUNK_FRAMES if speaking else SILENCE_CHUNK_FRAMES):
            self._flush_audio()

    def _flush_audio(self) -> None:
        if not self._out:
            return
        self._send(wire.encode(wire.OutputAudioDelta(delta=bytes(self._out))))
        self.metrics.audio_out_seconds.inc(self._out_frames * FRAME_MS / 1000)
        self._out.clear()
        self._out_frames = 0

    def _on_model_audio(self, frame: OutputFrame) -> None:
        if not frame.model_samples:
            return  # a fixture
        latency = self._turn_latency.reply_frame(frame.turn_id, time.monotonic())
        if latency is not None:
            self.metrics.turn_latency.observe(latency)

    def _emit_output_transcripts(self, deltas: tuple[TranscriptDelta, ...] | list[TranscriptDelta]) -> None:
        for d in deltas:
            if not d.text:
                continue
            start = max(d.start_ms, self._last_output_ms)
            self._last_output_ms = start
            self.emit(wire.OutputTranscriptDelta(delta=d.text, start_ms=start, end_ms=max(start, d.end_ms)))

    def on_output_frame(self, frame: OutputFrame) -> None:
        """For transports that pace output themselves (WebRTC): transcripts and latency of a frame just sent."""
        if self.state != "active":
            return
        if frame.speaking:
            self._on_model_audio(frame)
        self._out_speaking = frame.speaking
        self.metrics.audio_out_seconds.inc(FRAME_MS / 1000)
        if frame.transcripts:
            self._emit_output_transcripts(frame.transcripts)

    # --- engine events --------------------------------------------------------------------------------------
    def _on_engine_event(self, ev: p.SessionEvent) -> None:
        """One engine event, from the bridge's pump (model text has already gone to the player)."""
        if self.state == "closed":
            return  # session.closed was the last event; the bridge stops when the end completes
        match ev:
            case p.SessionClosed():
                self.spawn(self._engine_closed(ev.reason))
            case p.InputTranscript(final=True):
                text = ev.text.strip()
                if text:
                    start = max(ev.start_ms, self._last_input_ms)
                    self._last_input_ms = start
                    self.emit(
                        wire.InputTranscriptDelta(delta=text, start_ms=start, end_ms=max(start, ev.end_ms))
                    )
            case p.SpeechStarted():
                self._turn_latency.caller_started()
            case p.SpeechStopped():
                if (latency := self._turn_latency.caller_stopped(time.monotonic())) is not None:
                    self.metrics.turn_latency.observe(latency)
            case p.BargeIn():
                self.metrics.barge_ins.inc()
            case p.Usage():
                self._context = (ev.context_tokens, ev.context_limit)
            case p.SessionError(fatal=True):
                self._fatal = ev  # the engine closes the session next; the close reports it
            case p.SessionError():
                self.emit(wire.error_event(ev.code, ev.message, type=wire.SERVER_ERROR))

    async def _engine_closed(self, reason: str) -> None:
        if self.state == "closed":
            return
        fatal = self._fatal
        if reason == "engine_lost" or (fatal is not None and fatal.code == p.ErrorCode.ENGINE_LOST):
            code, message = (
                "engine_lost",
                "the engine stopped; this session cannot continue (a new one can start)",
            )
        elif fatal is not None:
            code, message = fatal.code, fatal.message
        else:
            code, message = "session_ended", f"the engine ended the session ({reason})"
        await self.end(
            "connection_lost",
            code=CLOSE_INTERNAL,
            error=wire.error_event(code, message, type=wire.SERVER_ERROR),
        )

    # --- housekeeping ---------------------------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        limits = self.settings.limits
        deadline = self.started_at + limits.session_lifetime_s
        next_usage = self.started_at + USAGE_INTERVAL_S
        while self.state == "active":
            now = time.monotonic()
            if now >= deadline:
                await self.end("expired", code=CLOSE_NORMAL)
                return
            if now >= next_usage:
                next_usage += USAGE_INTERVAL_S
                self.emit(self._usage_event())
            await asyncio.sleep(min(1.0, max(0.01, deadline - time.monotonic())))

    def _usage_event(self) -> wire.UsageUpdated:
        window = None
        if self._context is not None and self._context[1] > 0:
            window = wire.ContextWindow(usage_ratio=round(self._context[0] / self._context[1], 4))
        return wire.UsageUpdated(usage=wire.usage(self.usage_seconds()), context_window=window)

    # --- the end --------------------------------------------------------------------------------------------
    async def end(
        self,
        reason: wire.CloseReason | None,
        *,
        code: int,
        error: wire.Error | None = None,
        client_event_id: str | None = None,
        notify: bool = True,
        close_reason: str | None = None,
    ) -> None:
        """End the session once: optional ``error``, then ``session.closed`` (``reason``), then close ``code``.

        ``notify=False``: the client is already gone; nothing is sent."""
        if self.state == "closed":
            return
        was_active = self.state == "active"
        self.state = "closed"
        self.hub.discard(self)
        self.hub.detached.discard(self)
        if self.resume_token is not None:
            self.hub.resume_tokens.revoke(self.resume_token)
        current = asyncio.current_task()
        for t in list(self._tasks):
            if t is not current:
                t.cancel()
        if self._replaying_to is not None and self._detached is not None:
            # Ending while a resumed client is sent its backlog: the rest goes out first, then the end.
            target, buffer = self._replaying_to, self._detached
            while buffer.pending:
                target.send(buffer.pop())
            self.transport = target
            self._replaying_to = None
        if notify and was_active:
            self._flush_audio()
        if notify and error is not None:
            self.emit(error)
        if notify and was_active and reason is not None and self.config is not None:
            self.emit(self._usage_event())  # the final cumulative figure, then the terminal event
            self.emit(
                wire.SessionClosed(
                    client_event_id=client_event_id,
                    reason=reason,
                    session=self.resource(),
                    usage=wire.usage(self.usage_seconds()),
                )
            )
        if was_active:
            self.metrics.active_sessions.labels(transport=self.transport.kind).dec()
        await self.transport.close(code, close_reason or reason or "")
        # The bridge stops touching the rings before the engine session releases them.
        engine_reason = "client" if reason in (None, "close_requested") else reason
        if self.bridge is not None:
            await self.bridge.close(engine_reason)
        elif self.engine is not None:
            await self.engine.close(engine_reason)
        log.info("session %s ended: %s (close %d)", self.id, reason or "client gone", code)

    async def transport_closed(self) -> None:
        """The client went away (socket closed, peer failed): release everything, send nothing."""
        await self.end(None, code=CLOSE_NORMAL, notify=False)

    async def abort(self, code: str, message: str, *, close_code: int) -> None:
        await self.end(
            "connection_lost", code=close_code, error=wire.error_event(code, message, type=wire.SERVER_ERROR)
        )
