"""One OpenAI Live session, translated to one engine session. Shared by the WebSocket and the WebRTC data channel.

The translation is thin on purpose: turn-taking, replies, barge-in and the conversation live in the engine; the
media plane (``media``) converts audio and paces output; the session core (:mod:`livekit_omni.sessions`) owns the
lifecycle, the way in and out, housekeeping and the end. This class is the Live dialect on that core: it decodes
Live commands and carries them out (``AppendText``, ``SetMute``, ``Interrupt``, fixtures), projects engine events
onto Live events (transcripts, usage, ``session.closed``), chunks output audio into deltas, and keeps what only
Live has: ``session.start``, resume after a dropped connection, the per-turn latency clock, and delegation (a
reply that ends in a function call is a delegation to the Responses backend, which is the engine's own thinker, or
to the application: livekit_omni.live.delegation).

Who runs what (all on the event loop, never blocking it):

* the transport's receive loop calls :meth:`~livekit_omni.sessions.base.DialectSession.handle_text` for each
  client message, in order;
* the session's :class:`~media.bridge.SessionBridge` owns its ingress writer, egress player, engine event pump
  and engine keep-alive, as for every consumer of an engine session (the WebRTC peer uses the bridge's writer and
  player);
* one task per session does the 1 s housekeeping (lifetime, usage);
* the hub ticks every WebSocket session's output once per 20 ms from one shared clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

import msgspec
import numpy as np

from engine_bridge import protocol as p
from engine_bridge.control import EngineRequestError
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, FRAME_MS
from livekit_omni.live import delegation as dg
from livekit_omni.live import wire
from livekit_omni.live.fixtures import FixtureOverlay
from livekit_omni.live.turn_latency import TurnLatencyClock
from livekit_omni.sessions.base import ENGINE_REQUEST_TIMEOUT_S, DialectSession
from livekit_omni.sessions.errors import INVALID_REQUEST, WireError
from livekit_omni.sessions.hub import TRY_AGAIN_CODES, SessionHub
from livekit_omni.sessions.resume import TRANSPORT_MISMATCH, DetachedTransport
from livekit_omni.sessions.state import SessionState
from livekit_omni.sessions.tools import engine_refusal
from livekit_omni.sessions.transport import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN,
    Transport,
)
from media.egress import EgressPlayer, OutputFrame, TranscriptDelta
from media.ingress import IngressWriter

log = logging.getLogger(__name__)

#: Cumulative ``session.usage.updated`` cadence.
USAGE_INTERVAL_S: Final = 5.0
#: Output audio is sent in chunks of this many 20 ms frames while the model speaks (40 ms: a small lead for
#: barge-in, half the messages of 20 ms) and of ``SILENCE_CHUNK_FRAMES`` while it is silent (100 ms: the largest
#: chunk the protocol recommends; silence costs a fifth of the messages). A frame with model audio flushes pending
#: silence at once, so speech is never held behind silence.
SPEECH_CHUNK_FRAMES: Final = 2
SILENCE_CHUNK_FRAMES: Final = 5
#: Transports whose sessions survive a dropped connection (``resume_grace_s``).
RESUMABLE_TRANSPORTS: Final = frozenset({"websocket", "webrtc"})


class LiveSession(DialectSession[wire.ClientCommand, wire.ServerEvent]):
    """One Live session over one transport. See the module docstring."""

    dialect = "live"
    id_prefix = "live_"

    def __init__(self, hub: SessionHub, transport: Transport, *, accepts_start: bool = True) -> None:
        super().__init__(hub, transport, wire.CODEC)
        self.accepts_start = accepts_start
        self.config: wire.ResolvedConfig | None = None
        self.player: EgressPlayer | None = None
        #: Where output frames are pulled from: the player with fixture overlay.
        self.output: FixtureOverlay | None = None
        self.writer: IngressWriter | None = None
        self.expires_at = 0
        # Mute as the client asked for it; the engine is also muted while a fixture plays.
        self.user_muted = False
        self._fixture_playing = False
        self._fixture_client_event_id: str | None = None
        # Output chunking (WebSocket).
        self._out = bytearray()
        self._out_frames = 0
        self._out_speaking = False
        self._last_input = 0.0
        # The ingress writer's overrun and dropped-sample counts already added to the metrics.
        self._overruns_counted = 0
        self._dropped_counted = 0
        # Timeline bookkeeping: input transcripts are kept non-decreasing.
        self._last_input_ms = 0
        self._last_output_ms = 0
        self._turn_latency = TurnLatencyClock()
        self._next_usage = 0.0
        # How the session ends (``session.closed``'s reason and the command that asked for it), set by close_as.
        self._closed_as: wire.CloseReason | None = "connection_lost"
        self._closed_client_event_id: str | None = None
        # Resume (livekit_omni.sessions.resume): the token of the last session.started; while detached (and while a
        # resumed client is sent the backlog) the buffer that stands in for the transport.
        self.resume_token: str | None = None
        self._detached: DetachedTransport | None = None
        self._replaying_to: Transport | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._grace_task: asyncio.Task[None] | None = None
        #: A connection's first session: set when its ``session.resume`` took over an existing session instead.
        self.successor: LiveSession | None = None
        # Delegation (livekit_omni.live.delegation): the engine session's tools as the delegation gave them, the
        # non-fatal refusals of the start (sent after session.started), the backend's calls by call id, the
        # delegation of the newest output since the last continuation, the continuation under way, and the client
        # delegations (id -> the engine call that is still open until the application first answers).
        self.engine_tools = dg.EngineTools()
        self._start_warnings: list[WireError] = []
        self._backend_calls: dict[str, dg.BackendCall] = {}
        self._answered_delegation: str | None = None
        self._continuation: dg.BackendResponse | None = None
        self._client_delegations: dict[str, str | None] = {}
        #: WebRTC data channels (``client.data_channel``): the nested Responses events ``response.event`` may carry
        #: (None: all).
        self.allowed_response_events: frozenset[str] | None = None

    # --- the dialect's wire --------------------------------------------------------------------------------
    def slim(self, ev: wire.ServerEvent) -> wire.ServerEvent | None:
        """The session resource loses its echo-only history and instructions; no other event has a slimmer form."""
        if isinstance(ev, wire.SessionStarted | wire.SessionUpdated | wire.SessionClosed):
            return msgspec.structs.replace(
                ev, session=msgspec.structs.replace(ev.session, input=None, instructions=None)
            )
        return None

    def resource(self) -> wire.SessionResource:
        assert self.config is not None
        caps = self.hub.supervisor.engine_info.get("capabilities")
        return wire.session_resource(
            self.config,
            session_id=self.id,
            expires_at=self.expires_at,
            capabilities=caps if isinstance(caps, dict) else None,
        )

    # --- receive path -----------------------------------------------------------------------------------------
    async def receive(self, cmd: wire.ClientCommand) -> None:
        if isinstance(cmd, wire.SessionStart):
            await self._on_start(cmd)
            return
        if isinstance(cmd, wire.SessionResume):
            await self._on_resume(cmd)
            return
        if self.state is not SessionState.ACTIVE:
            raise WireError(
                "session_not_started",
                f"send session.start and wait for session.started before {wire.event_type(cmd)}",
                param="type",
            )
        await self._dispatch(cmd)

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
                    await self._apply_delegation(delegation, cid)
                self.emit(wire.SessionUpdated(client_event_id=cid, session=self.resource()))
            case wire.ResponseItemCreate():
                await self._on_response_item(cmd)
            case wire.ResponseCreate():
                await self._on_response_create(cmd)
            case wire.SessionClose():
                await self.close_as("close_requested", code=CLOSE_NORMAL, client_event_id=cid)
            case _:
                raise WireError("unknown_event", f"unhandled event {type(cmd).__name__}")

    # --- session.start ----------------------------------------------------------------------------------------
    async def _on_start(self, cmd: wire.SessionStart) -> None:
        if not self.accepts_start:
            raise WireError(
                "session_already_started",
                "this session was started by the WebRTC offer; session.start is not used on the data channel",
                param="type",
            )
        if self.state is not SessionState.NEW:
            raise WireError(
                "session_already_started", "session.start was already sent on this connection", param="type"
            )
        try:
            cfg = wire.resolve_config(cmd.session, with_format=True)
        except WireError as e:
            # A refused start ends the connection: LiveKit would otherwise wait for session.started forever.
            await self.refuse(e, close_code=CLOSE_POLICY, client_event_id=cmd.event_id)
            return
        if await self.open(cfg, client_event_id=cmd.event_id):
            self.announce(client_event_id=cmd.event_id)

    async def open(self, cfg: wire.ResolvedConfig, *, client_event_id: str | None = None) -> bool:
        """Open the engine session for ``cfg``. On refusal: an ``error`` event, a close, and False.

        (WebRTC calls this before answering the offer and reports refusals as HTTP errors instead; see
        :meth:`open_or_raise`.)"""
        try:
            await self.open_or_raise(cfg)
        except WireError as e:
            self.emit_error(e, client_event_id)
            if e.code in TRY_AGAIN_CODES:
                code = CLOSE_TRY_AGAIN
            elif e.type == INVALID_REQUEST:
                code = CLOSE_POLICY  # a configuration the engine cannot serve (tools it refused)
            else:
                code = CLOSE_INTERNAL
            await self.end(code=code, reason=e.code, notify=False)
            return False
        return True

    async def open_or_raise(self, cfg: wire.ResolvedConfig) -> None:
        """Open the engine session; raises WireError (``session_limit_reached``, ``engine_unavailable``, tools the
        engine refuses: ``invalid_value``, …)."""
        self.config = cfg
        tools = self._delegation_tools(cfg.delegation)
        if tools.refused is not None:
            self._start_warnings.append(tools.refused)
        try:
            await self.open_engine(
                p.SessionConfig(
                    instructions=dg.engine_instructions(cfg.instructions, cfg.delegation),
                    history=[p.ChatTurn(role=r, text=t) for r, t in cfg.history],  # type: ignore[arg-type]
                    voice=cfg.voice_name,
                    tools=tools.tools,
                    tool_choice=tools.choice,
                    acknowledgement_delay_ms=cfg.delegation.acknowledgement_delay_ms or 0,
                )
            )
        except WireError as e:
            cause = e.__cause__
            if isinstance(cause, EngineRequestError):
                refusal = engine_refusal(cause, self._tools_param(cfg.delegation))
                if refusal is not None:
                    raise refusal from cause
            raise
        self.engine_tools = tools

    def announce(self, *, client_event_id: str | None = None) -> None:
        """Send ``session.started`` and start the session's clocks (after the engine session is open)."""
        assert self.bridge is not None and self.config is not None
        self.expires_at = int(time.time() + self.settings.limits.session_lifetime_s)
        self.activate()
        self._last_input = self.started_at
        self._next_usage = self.started_at + USAGE_INTERVAL_S
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
        for warning in self._start_warnings:  # tools left out of the session: it goes on without them
            self.emit_error(warning, client_event_id)
        self._start_warnings.clear()
        if self.transport.carries_audio and self.output is not None:
            self.hub.start_ticking(self)

    def attach_player(self, player: EgressPlayer) -> FixtureOverlay:
        """Use ``player`` for output (model text goes to it); returns the overlay to pull frames from."""
        self.player = player
        self.output = FixtureOverlay(player, self._on_fixture_done)
        return self.output

    # --- resume (livekit_omni.sessions.resume) -------------------------------------------------------------------
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
        if not self.accepts_start or self.state is not SessionState.NEW:
            raise WireError(
                "session_already_started",
                "session.resume is only accepted as the first command of a connection",
                param="type",
            )
        tokens = self.hub.resume_tokens
        peeked = tokens.peek(cmd.resume_token)
        try:
            if isinstance(peeked, LiveSession) and peeked.transport.kind != self.transport.kind:
                raise WireError(
                    TRANSPORT_MISMATCH,
                    f"this token resumes a {peeked.transport.kind} session; resume it there",
                    param="resume_token",
                )
            target = tokens.take(cmd.resume_token)
            assert isinstance(target, LiveSession)  # only Live sessions issue tokens
        except WireError as e:
            # The connection stays usable: the client may start a new session on it.
            self.metrics.resume_refused.labels(code=e.code).inc()
            self.emit_error(e, cid)
            return
        self.advance(SessionState.CLOSED)
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
        self.spawn(self.end(code=CLOSE_NORMAL, notify=False))

    async def transport_lost(self, transport: Transport, *, may_detach: bool = True) -> None:
        """``transport`` dropped without ``session.close``: detach for a resume when allowed (``may_detach``, the
        session resumable, the server not draining), else end."""
        if self.state.ending:
            return
        if transport is not self.transport and transport is not self._replaying_to:
            return  # a connection this session has already left (a resume took it over)
        if (
            not may_detach
            or self.state is not SessionState.ACTIVE
            or not self.resumable
            or not self.hub.admitting
        ):
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
            await self.end(code=CLOSE_NORMAL, notify=False)

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
        if self.state is not SessionState.ACTIVE or self._replaying_to is not transport:
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
        self.send_frame(started, to=transport)
        self.metrics.sessions_resumed.inc()
        log.info("session %s: resumed (%d events kept)", self.id, len(buffer.pending))
        self._replay_task = self.spawn(self._replay(buffer, transport))

    async def _replay(self, buffer: DetachedTransport, transport: Transport) -> None:
        """Send the backlog at the pace the connection takes it; once it is empty, events go straight out."""
        while buffer.pending:
            await transport.put(buffer.pop())
        if self._replaying_to is transport and self.state is SessionState.ACTIVE:
            self.transport = transport
            self._detached = None
            self._replaying_to = None
            self._replay_task = None

    # --- input audio ----------------------------------------------------------------------------------------
    def _on_audio(self, cmd: wire.InputAudioAppend) -> None:
        if not self.transport.carries_audio or self.writer is None or self.config is None:
            raise WireError(
                "unsupported_event",
                "on WebRTC, caller audio travels on the media track, not in session.input_audio.append",
                param="type",
            )
        fmt = self.config.format
        assert fmt is not None
        raw = wire.decode_audio(cmd.audio, fmt)
        seconds = len(raw) / fmt.bytes_per_sample / fmt.rate
        self._last_input = time.monotonic()
        if not self.admit_input(seconds):
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

    def on_backpressure_close(self) -> None:
        # The client was told once (input_backpressure); now the session ends as a lost connection.
        self.spawn(self.close_as("connection_lost", code=CLOSE_TRY_AGAIN, close_reason="input_backpressure"))

    # --- appends, fixtures, mute ----------------------------------------------------------------------------
    async def _on_append(self, cmd: wire.TextAppend) -> None:
        assert self.engine is not None
        kind, ack = wire.APPEND_KINDS[type(cmd)]
        if self._fixture_playing:
            raise WireError("fixture_active", "appends are refused while an audio fixture plays")
        if len(cmd.content) > wire.MAX_APPEND_CHARS:
            raise WireError(
                "content_too_long",
                f"content is limited to {wire.MAX_APPEND_CHARS} characters",
                param="content",
            )
        if cmd.delegation_id is not None:
            await self._answer_delegation(cmd.delegation_id)
        landed = await self.engine.append_text(kind, cmd.content)
        start, end = landed.start_ms, max(landed.start_ms, landed.end_ms)
        self.emit(ack(client_event_id=cmd.event_id, start_ms=start, end_ms=end))

    # --- delegation (livekit_omni.live.delegation) -----------------------------------------------------------------
    def _engine_runs_tools(self) -> bool:
        caps = self.hub.supervisor.engine_info.get("capabilities")
        return isinstance(caps, dict) and bool(caps.get("tools"))

    def _delegation_tools(self, d: wire.Delegation) -> dg.EngineTools:
        """The engine tools of delegation ``d`` (a ``responses`` delegation's echo keeps only the served tools).
        Raises WireError for a malformed tool or choice."""
        assert self.config is not None
        if d.type != "responses":
            return dg.client_tools(
                d, delegates=self.config.delegates_to_client, engine_runs_tools=self._engine_runs_tools()
            )
        responses = d.responses if d.responses is not None else {}
        runs = self._engine_runs_tools()
        tools = dg.responses_tools(responses, engine_runs_tools=runs)
        if "tools" in responses:
            responses["tools"] = tools.served
        if not runs and tools.refused is not None:
            responses.pop("tool_choice", None)  # not served either: the echo says what the session runs
        return tools

    @staticmethod
    def _tools_param(d: wire.Delegation) -> str:
        return f"{dg.RESPONSES_PARAM}.tools" if d.type == "responses" else "session.delegation.tool_choice"

    async def _apply_delegation(self, new: wire.Delegation, cid: str | None) -> None:
        """A ``session.update``'s delegation: what changed reaches the engine session (tools, tool choice, the
        backend's instructions, the acknowledgement delay); a refusal leaves the session as it was."""
        assert self.config is not None and self.engine is not None
        old = self.config.delegation
        if new.responses is not None:
            new.responses = dict(new.responses)  # the echo is edited below; the current one stays as it was
        tools = self._delegation_tools(new)
        changes: dict[str, object] = {}
        if tools.tools != self.engine_tools.tools:
            changes["tools"] = tools.tools
        if tools.choice != self.engine_tools.choice:
            changes["tool_choice"] = tools.choice
        instructions = dg.engine_instructions(self.config.instructions, new)
        if instructions != dg.engine_instructions(self.config.instructions, old):
            changes["instructions"] = instructions
        if new.acknowledgement_delay_ms != old.acknowledgement_delay_ms:
            changes["acknowledgement_delay_ms"] = new.acknowledgement_delay_ms or 0
        if changes:
            try:
                await asyncio.wait_for(
                    self.engine.update(**changes),  # type: ignore[arg-type]
                    ENGINE_REQUEST_TIMEOUT_S,
                )
            except EngineRequestError as e:
                param = self._tools_param(new)
                if new.type == "responses" and "tools" not in changes:
                    param = f"{dg.RESPONSES_PARAM}.tool_choice"
                refusal = engine_refusal(e, param)
                if refusal is None:
                    raise
                raise refusal from e
        self.engine_tools = tools
        self.config.delegation = new
        if tools.refused is not None:
            self.emit_error(tools.refused, cid)

    def _offset_ms(self) -> int:
        return max(0, int((time.monotonic() - self.started_at) * 1000)) if self.started_at else 0

    def _backend_model(self) -> str:
        assert self.config is not None
        model = (self.config.delegation.responses or {}).get("model")
        return model if isinstance(model, str) and model else self.config.model

    def _emit_backend(
        self, r: dg.BackendResponse, event: wire.ResponsesStreamEvent, client_event_id: str | None = None
    ) -> None:
        allowed = self.allowed_response_events
        if allowed is not None and event.__struct_config__.tag not in allowed:
            return
        self.emit(
            wire.ResponseEvent(event=event, delegation_id=r.delegation_id, client_event_id=client_event_id)
        )

    def _backend_calls_of(self, r: dg.BackendResponse, calls: list[p.ToolCallItem]) -> None:
        for call in calls:
            self._backend_calls[call.call_id] = dg.BackendCall(call.call_id, r.delegation_id)
            for event in r.call(call):
                self._emit_backend(r, event)

    def _require_responses(self, what: str) -> None:
        assert self.config is not None
        if self.config.delegation.type != "responses":
            raise WireError(
                "responses_delegation_required",
                f"{what} requires responses delegation; this session uses {self.config.delegation.type} delegation",
                param="type",
            )

    async def _answer_delegation(self, delegation_id: str) -> None:
        """An append carrying ``delegation_id``: the application answers its client delegation. The first answer
        closes the engine's call (its result says the application took the task)."""
        assert self.config is not None and self.engine is not None
        if self.config.delegation.type == "responses":
            raise WireError(
                "invalid_value",
                "delegation_id must be null under responses delegation (tool results go in response.item.create)",
                param="delegation_id",
            )
        if delegation_id not in self._client_delegations:
            raise WireError(
                "unknown_delegation",
                f"no delegation {delegation_id!r} was created in this session",
                param="delegation_id",
            )
        call_id = self._client_delegations[delegation_id]
        if call_id is not None:
            self._client_delegations[delegation_id] = None
            await asyncio.wait_for(
                self.engine.append_text("tool_result", dg.HANDED_OVER, call_id=call_id),
                ENGINE_REQUEST_TIMEOUT_S,
            )

    async def _on_response_item(self, cmd: wire.ResponseItemCreate) -> None:
        """``response.item.create``: a call's output becomes its result in the engine's conversation (said only
        when a ``response.create`` asks); a message joins the conversation as context."""
        assert self.engine is not None
        self._require_responses("response.item.create")
        item = cmd.item
        kind = item.get("type", "message")
        if kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise WireError(
                    "missing_required_parameter",
                    "a function_call_output needs a call_id",
                    param="item.call_id",
                )
            call = self._backend_calls.get(call_id)
            if call is None or call.answered:
                raise WireError(
                    "invalid_value",
                    f"no function call {call_id!r} awaits an output in this session"
                    + (" (it has its output already)" if call is not None else ""),
                    param="item.call_id",
                )
            text = dg.output_text(item)
            await asyncio.wait_for(
                self.engine.append_text("tool_result", text, call_id=call_id), ENGINE_REQUEST_TIMEOUT_S
            )
            call.answered = True
            self._answered_delegation = call.delegation_id
        elif kind == "message":
            append, text = dg.message_append(item)
            if text:
                await asyncio.wait_for(self.engine.append_text(append, text), ENGINE_REQUEST_TIMEOUT_S)
        else:
            raise WireError(
                "invalid_value",
                f"item type {str(kind)[:100]!r} is not taken here: send a function_call_output or a message",
                param="item.type",
            )

    async def _on_response_create(self, cmd: wire.ResponseCreate) -> None:
        """``response.create``: the continuation once every call has its output (or a response the application
        asks for): the model speaks, framed by the backend response's ``response.created``/``completed``."""
        assert self.engine is not None
        self._require_responses("response.create")
        if self._continuation is not None:
            raise WireError(
                "response_in_progress",
                f"the backend's response {self._continuation.id} is still running; wait for its response.completed",
            )
        waiting = [c.call_id for c in self._backend_calls.values() if not c.answered]
        if waiting:
            raise WireError(
                "missing_tool_outputs",
                f"function calls {', '.join(waiting)} have no output yet: the backend continues once every call "
                "has its function_call_output",
            )
        self._backend_calls.clear()  # every call is answered: this continuation consumes them
        r = dg.BackendResponse(
            dg.new_id("resp"),
            self._answered_delegation,
            self._backend_model(),
            dg.continuation_choice(self.engine_tools.choice),
        )
        self._answered_delegation = None
        self._continuation = r  # before the reply can start: the next reply to start is its
        try:
            await asyncio.wait_for(
                self.engine.append_text("respond", "", tool_choice=r.choice), ENGINE_REQUEST_TIMEOUT_S
            )
        except BaseException:
            if self._continuation is r:
                self._continuation = None
            raise
        self._emit_backend(r, r.created(), cmd.event_id)

    def _on_reply_started(self, ev: p.ReplyStarted) -> None:
        r = self._continuation
        if r is not None and r.reply is None:
            r.reply = (ev.epoch, ev.turn_id)

    def _on_reply_done(self, ev: p.ReplyDone) -> None:
        """A reply ended: the continuation it was completes (with the calls it made), or its calls are a new
        delegation (``responses``: the backend response's whole stream; ``client``: the hand-off)."""
        assert self.config is not None
        r = self._continuation
        if r is not None and r.reply == (ev.epoch, ev.turn_id):
            if not ev.interrupted and not ev.tool_calls and ev.output_tokens == 0:
                # Said as it is, nothing generated: the engine's automatic acknowledgement, which started before
                # the continuation. The continuation is the next reply.
                r.reply = None
                return
            self._backend_calls_of(r, list(ev.tool_calls))
            self._continuation = None
            self._emit_backend(r, r.completed(dg.usage_of(ev)))
            return
        if ev.interrupted or not ev.tool_calls:
            return  # a reply cut by a barge-in makes no call
        if self.config.delegation.type == "responses":
            did = dg.new_id("del")
            r = dg.BackendResponse(dg.new_id("resp"), did, self._backend_model(), self.engine_tools.choice)
            self.emit(
                wire.DelegationCreated(
                    delegation=wire.DelegationInfo(
                        id=did, target="responses", type="delegation", response_id=r.id
                    ),
                    offset_ms=self._offset_ms(),
                )
            )
            self._emit_backend(r, r.created())
            self._backend_calls_of(r, list(ev.tool_calls))
            self._emit_backend(r, r.completed(dg.usage_of(ev)))
            return
        for call in ev.tool_calls:
            if call.name != dg.DELEGATE_TOOL.name:
                log.warning("session %s: a call of %r under client delegation; ignored", self.id, call.name)
                continue
            did = dg.new_id("del")
            self._client_delegations[did] = call.call_id
            self.emit(
                wire.DelegationCreated(
                    delegation=wire.DelegationInfo(id=did, target="client", type="delegation"),
                    offset_ms=self._offset_ms(),
                )
            )

    async def _set_engine_mute(self, muted: bool) -> None:
        assert self.engine is not None
        await asyncio.wait_for(self.engine.set_mute(muted), ENGINE_REQUEST_TIMEOUT_S)

    async def _on_fixture(self, cmd: wire.FixturePlay) -> None:
        assert self.engine is not None
        raw = wire.decode_audio(cmd.audio, wire.FIXTURE_FORMAT)
        seconds = len(raw) / 2 / ENGINE_OUTPUT_RATE
        limit = self.settings.limits.max_fixture_s
        if not raw:
            raise WireError("invalid_audio", "the fixture holds no audio", param="audio")
        if seconds > limit:
            raise WireError(
                "fixture_too_long", f"the fixture is {seconds:.1f} s; at most {limit:g} s", param="audio"
            )
        if self._fixture_playing:
            raise WireError("fixture_active", "another fixture is playing")
        if self.output is None:
            raise WireError("fixture_unavailable", "this session has no output audio to play a fixture on")
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
        if self.state is not SessionState.ACTIVE:
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
            if not self.user_muted and self.state is SessionState.ACTIVE:
                await self._set_engine_mute(False)
        finally:
            self._fixture_playing = False
            self._fixture_client_event_id = None
        if self.state is SessionState.ACTIVE:
            self.emit(wire.FixturePlayed(client_event_id=cid))

    # --- output (WebSocket): one 20 ms frame per tick of the hub's clock -------------------------------------
    def tick(self) -> None:
        output = self.output
        if output is None or self.state is not SessionState.ACTIVE:
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
        self.send_frame(wire.encode(wire.OutputAudioDelta(delta=bytes(self._out))))
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
        if self.state is not SessionState.ACTIVE:
            return
        if frame.speaking:
            self._on_model_audio(frame)
        self._out_speaking = frame.speaking
        self.metrics.audio_out_seconds.inc(FRAME_MS / 1000)
        if frame.transcripts:
            self._emit_output_transcripts(frame.transcripts)

    # --- engine events --------------------------------------------------------------------------------------
    def on_engine_event(self, ev: p.SessionEvent) -> None:
        match ev:
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
            case p.ReplyStarted():
                self._on_reply_started(ev)
            case p.ReplyDone():
                self._on_reply_done(ev)

    # --- housekeeping -----------------------------------------------------------------------------------------
    def on_housekeeping(self, now: float) -> None:
        if now >= self._next_usage:
            self._next_usage += USAGE_INTERVAL_S
            self.emit(self._usage_event())

    def _usage_event(self) -> wire.UsageUpdated:
        window = None
        if self.context is not None and self.context[1] > 0:
            window = wire.ContextWindow(usage_ratio=round(self.context[0] / self.context[1], 4))
        return wire.UsageUpdated(usage=wire.usage(self.usage_seconds()), context_window=window)

    # --- the end --------------------------------------------------------------------------------------------
    async def close_as(
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
        if not self.state.ending:
            self._closed_as, self._closed_client_event_id = reason, client_event_id
        await self.end(
            code=code,
            reason=close_reason or reason or "",
            notify=notify,
            error=error,
            engine_reason=p.CloseReason.CLIENT
            if reason in (None, "close_requested")
            else p.CloseReason(reason),
        )

    async def end(
        self,
        *,
        code: int,
        reason: str = "",
        notify: bool = True,
        error: wire.ServerEvent | None = None,
        engine_reason: p.CloseReason = p.CloseReason.CLIENT,
    ) -> None:
        if not self.state.ending:
            # What only Live has: the resume token dies with the session, and a resumed client being sent its
            # backlog gets the rest of it before the end.
            if self.resume_token is not None:
                self.hub.resume_tokens.revoke(self.resume_token)
            if self._replaying_to is not None and self._detached is not None:
                target, buffer = self._replaying_to, self._detached
                while buffer.pending:
                    target.send(buffer.pop())
                self.transport = target
                self._replaying_to = None
        await super().end(code=code, reason=reason, notify=notify, error=error, engine_reason=engine_reason)

    def farewell(self, *, was_active: bool, error: wire.ServerEvent | None) -> None:
        """Pending audio, the ``error`` if any, then the final usage and ``session.closed``."""
        if was_active:
            self._flush_audio()
        if error is not None:
            self.emit(error)
        if was_active and self._closed_as is not None and self.config is not None:
            self.emit(self._usage_event())  # the final cumulative figure, then the terminal event
            self.emit(
                wire.SessionClosed(
                    client_event_id=self._closed_client_event_id,
                    reason=self._closed_as,
                    session=self.resource(),
                    usage=wire.usage(self.usage_seconds()),
                )
            )

    async def abort(self, code: str, message: str, *, close_code: int) -> None:
        await self.close_as(
            "connection_lost",
            code=close_code,
            error=wire.error_event(code, message, type=wire.SERVER_ERROR),
        )

    async def expire(self) -> None:
        await self.close_as("expired", code=CLOSE_NORMAL)
