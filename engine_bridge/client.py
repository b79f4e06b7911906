"""The serving side's handle on an engine: open sessions (creating their rings), route their events, survive loss.

Used by everything that feeds the engine: the OpenAI Live facade, the WebRTC media plane and the co-located
LiveKit plugin. It owns the rings it creates (it unlinks them when a session closes, and when the engine is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Final

from engine_bridge import protocol as p
from engine_bridge.control import Address, ControlClient, EngineLostError, EngineRequestError, R, result_as
from engine_bridge.doorbell import DoorbellButton
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE
from engine_bridge.ring import RingPair

log = logging.getLogger(__name__)

#: Events queued per session before the consumer is considered stuck. Audio never goes through here; at a few
#: dozen events per second this is minutes of slack, and overflow fails the session loudly instead of growing.
EVENT_QUEUE_LIMIT: Final = 4096


def new_session_id() -> str:
    return "sess_" + secrets.token_hex(12)


def new_text_id() -> str:
    return "text_" + secrets.token_hex(12)


class TextStream:
    """One text request (chat completion): its admission result, then its events until :class:`TextDone`.

    Its events are registered before StartText is sent (tokens may arrive before the reply). :meth:`abort` ends it
    in the engine (KV freed) and is what the HTTP side calls when its client goes away; idempotent, never raises.
    """

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.client = client
        self.id = request_id
        self.events: asyncio.Queue[p.TextEvent] = asyncio.Queue()
        self.started: p.TextStarted | None = None
        self.done: p.TextDone | None = None

    async def iter_events(self) -> AsyncIterator[p.TextDelta | p.TextDone]:
        """Deltas, then the final TextDone (yielded too)."""
        while True:
            ev = await self.events.get()
            yield ev
            if isinstance(ev, p.TextDone):
                return

    async def abort(self, *, timeout: float = 5.0) -> None:
        if self.done is None and not self.client.lost:
            with contextlib.suppress(EngineLostError, EngineRequestError, TimeoutError, Exception):
                await self.client.request(p.AbortText(req_id=0, request_id=self.id), timeout=timeout)
        self._finish()

    def _deliver(self, ev: p.TextEvent) -> None:
        self.events.put_nowait(ev)  # bounded by the request's max_tokens
        if isinstance(ev, p.TextDone):
            self.done = ev
            self._finish()

    def _finish(self) -> None:
        self.client.texts.pop(self.id, None)


class EngineSession:
    """One open session: its rings (owned here), its event stream and its commands."""

    def __init__(self, client: EngineClient, session_id: str, rings: RingPair) -> None:
        self.client = client
        self.id = session_id
        self.rings = rings
        self.events: asyncio.Queue[p.SessionEvent] = asyncio.Queue(EVENT_QUEUE_LIMIT)
        self.closed = False
        self.close_reason: p.CloseReason | None = None
        #: The engine reaps the session after this long without activity (set from its SessionOpened).
        self.idle_ttl_s = 0.0

    # --- audio -----------------------------------------------------------------------------------------------
    def ring_doorbell(self) -> None:
        """Tell the engine new caller audio is in the ingress ring (for writers that write the ring directly)."""
        if not self.closed:
            self.client.ring_doorbell()

    # --- commands ------------------------------------------------------------------------------------------
    async def append_text(
        self,
        kind: p.AppendKind,
        text: str,
        *,
        max_output_tokens: int = 0,
        tool_choice: p.ToolChoiceSpec | None = None,
        call_id: str = "",
        call: p.ToolCallItem | None = None,
    ) -> p.TextAppended:
        """Text into the conversation (``AppendText``): see its kinds. ``tool_choice`` with ``respond``; a
        ``tool_result`` names its ``call_id``; a ``tool_call`` carries the ``call``."""
        cmd = p.AppendText(
            req_id=0,
            session_id=self.id,
            kind=kind,
            text=text,
            max_output_tokens=max_output_tokens,
            tool_choice=tool_choice,
            call_id=call_id,
            call=call,
        )
        return await self.client.call(cmd, p.TextAppended)

    async def update(
        self,
        *,
        instructions: str | None = None,
        voice: str | None = None,
        turn_taking: p.TurnTakingConfig | None = None,
        temperature: float | None = None,
        max_output_tokens: int | None = None,
        tools: list[p.ToolDef] | None = None,
        tool_choice: p.ToolChoiceSpec | None = None,
        acknowledgement_delay_ms: int | None = None,
    ) -> None:
        """Change the running session's settings (``UpdateSession``; None keeps a setting)."""
        cmd = p.UpdateSession(
            req_id=0,
            session_id=self.id,
            instructions=instructions,
            voice=voice,
            turn_taking=turn_taking,
            temperature=temperature,
            max_output_tokens=max_output_tokens,
            tools=tools,
            tool_choice=tool_choice,
            acknowledgement_delay_ms=acknowledgement_delay_ms,
        )
        await self.client.call(cmd, p.Ack)

    async def set_mute(self, muted: bool) -> p.MuteSet:
        return await self.client.call(p.SetMute(req_id=0, session_id=self.id, muted=muted), p.MuteSet)

    async def interrupt(self) -> p.Interrupted:
        return await self.client.call(p.Interrupt(req_id=0, session_id=self.id), p.Interrupted)

    async def truncate_reply(self, turn_id: int, text: str) -> None:
        await self.client.call(
            p.TruncateReply(req_id=0, session_id=self.id, turn_id=turn_id, text=text), p.Ack
        )

    async def touch(self) -> None:
        await self.client.call(p.Touch(req_id=0, session_id=self.id), p.Ack)

    async def stats(self) -> p.SessionStats:
        return await self.client.call(p.GetStats(req_id=0, session_id=self.id), p.SessionStats)

    async def close(self, reason: p.CloseReason = p.CloseReason.CLIENT, *, timeout: float = 5.0) -> None:
        """Ask the engine to close the session, then release the rings. Idempotent, never raises."""
        if not self.closed and not self.client.lost:
            with contextlib.suppress(EngineLostError, EngineRequestError, TimeoutError, Exception):
                await self.client.request(
                    p.CloseSession(req_id=0, session_id=self.id, reason=reason), timeout=timeout
                )
        self._finish(reason)

    async def iter_events(self) -> AsyncIterator[p.SessionEvent]:
        """Events until the session closes (the final SessionClosed is yielded too)."""
        while True:
            ev = await self.events.get()
            yield ev
            if isinstance(ev, p.SessionClosed):
                return

    # --- bookkeeping ---------------------------------------------------------------------------------------
    def _deliver(self, ev: p.SessionEvent) -> None:
        try:
            self.events.put_nowait(ev)
        except asyncio.QueueFull:
            log.error(
                "session %s: event consumer is stuck (%d queued); closing the session",
                self.id,
                EVENT_QUEUE_LIMIT,
            )
            self._finish(p.CloseReason.EVENT_OVERFLOW)
            asyncio.get_running_loop().create_task(self.close(p.CloseReason.EVENT_OVERFLOW))

    def _finish(self, reason: p.CloseReason) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.client.sessions.pop(self.id, None)
        self.rings.close()


class EngineClient:
    def __init__(self, address: Address) -> None:
        self.address = address
        self.sessions: dict[str, EngineSession] = {}
        self.texts: dict[str, TextStream] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.lost = False
        self._control: ControlClient | None = None
        self._lost_event = asyncio.Event()
        self._bell: DoorbellButton | None = None

    @classmethod
    async def connect(
        cls, address: Address | str, *, timeout: float = 5.0, client_name: str = ""
    ) -> EngineClient:
        addr = Address.parse(address) if isinstance(address, str) else address
        self = cls(addr)
        self._control = await ControlClient.connect(
            addr, on_event=self._on_event, on_lost=self._on_lost, timeout=timeout, client_name=client_name
        )
        if self.hello is not None and self.hello.doorbell:
            self._bell = DoorbellButton(self.hello.doorbell)
        return self

    def ring_doorbell(self) -> None:
        """Wake the engine's audio thread once for everything written in this event-loop iteration."""
        if self._bell is not None:
            self._bell.ring_soon()

    @property
    def hello(self) -> p.EngineHealth | None:
        """The engine's health as it answered Hello."""
        return self._control.hello if self._control else None

    async def wait_lost(self) -> None:
        await self._lost_event.wait()

    async def request(self, cmd: p.Command, *, timeout: float = 5.0) -> p.Reply:
        if self._control is None or self.lost:
            raise EngineLostError("the engine is not connected")
        return await self._control.request(cmd, timeout=timeout)

    async def call(self, cmd: p.Command, result_type: type[R], *, timeout: float = 5.0) -> R:
        """Send ``cmd`` and return its reply's result as ``result_type`` (``p.RESULT_OF[type(cmd)]``)."""
        return result_as(await self.request(cmd, timeout=timeout), cmd, result_type)

    async def ping(self, timeout: float = 2.0) -> p.EngineHealth:
        return await self.call(p.Ping(req_id=0), p.EngineHealth, timeout=timeout)

    async def session_stats(self, session_id: str, timeout: float = 5.0) -> p.SessionStats:
        """Any session's stats by id (also one another client opened, e.g. a Live session's)."""
        return await self.call(p.GetStats(req_id=0, session_id=session_id), p.SessionStats, timeout=timeout)

    async def open_session(
        self,
        config: p.SessionConfig | None = None,
        *,
        session_id: str | None = None,
        ingress_seconds: float = 4.0,
        egress_seconds: float = 8.0,
        timeout: float = 10.0,
    ) -> EngineSession:
        """Create the session's rings and open it in the engine. Raises EngineRequestError (e.g. the session
        limit) or EngineLostError; the rings are released on any failure."""
        sid = session_id or new_session_id()
        rings = RingPair.create(
            input_rate=ENGINE_INPUT_RATE,
            output_rate=ENGINE_OUTPUT_RATE,
            ingress_seconds=ingress_seconds,
            egress_seconds=egress_seconds,
        )
        session = EngineSession(self, sid, rings)
        self.sessions[sid] = session  # registered first: events may arrive before the reply
        try:
            ing, eg = rings.names
            opened = await self.call(
                p.OpenSession(
                    req_id=0, session_id=sid, ingress=ing, egress=eg, config=config or p.SessionConfig()
                ),
                p.SessionOpened,
                timeout=timeout,
            )
        except BaseException:
            session._finish(p.CloseReason.OPEN_FAILED)
            raise
        session.idle_ttl_s = opened.idle_ttl_s
        return session

    async def start_text(
        self,
        messages: list[p.TextMessage],
        sampling: p.TextSampling,
        *,
        tools: list[p.ToolDef] | None = None,
        tool_choice: p.ToolChoiceSpec | None = None,
        timeout: float = 60.0,
    ) -> TextStream:
        """Start a text request on the engine's thinker (with ``tools``, the reply may end in a call: its TextDone
        says ``tool_calls``). Raises EngineRequestError (``capacity_exceeded``, ``context_length_exceeded``,
        ``invalid_tools``, ``unsupported``, ...) or EngineLostError. The reply comes after the prompt's prefill,
        which may wait behind voice work: hence the longer timeout."""
        stream = TextStream(self, new_text_id())
        self.texts[stream.id] = stream  # registered first: events may arrive before the reply
        try:
            stream.started = await self.call(
                p.StartText(
                    req_id=0,
                    request_id=stream.id,
                    messages=messages,
                    sampling=sampling,
                    tools=tools or [],
                    tool_choice=tool_choice or p.ToolChoiceSpec(),
                ),
                p.TextStarted,
                timeout=timeout,
            )
        except EngineRequestError:
            stream._finish()  # refused: nothing runs in the engine
            raise
        except BaseException:
            # Cancelled or timed out while waiting for admission: the engine may still start it, so abort it
            # (in a task of its own: this one is being cancelled).
            stream._finish()
            if not self.lost:
                task = asyncio.get_running_loop().create_task(self._abort_quietly(stream.id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise
        return stream

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.request(p.AbortText(req_id=0, request_id=request_id), timeout=5.0)

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.close(p.CloseReason.CLIENT_SHUTDOWN, timeout=2.0)
        if self._control is not None:
            await self._control.close()
        if self._bell is not None:
            self._bell.close()

    def _on_event(self, ev: p.SessionEvent | p.TextEvent) -> None:
        if isinstance(ev, p.TextDelta | p.TextDone):
            stream = self.texts.get(ev.request_id)
            if stream is not None:
                stream._deliver(ev)
            return
        session = self.sessions.get(ev.session_id)
        if session is None:
            return
        session._deliver(ev)
        if isinstance(ev, p.SessionClosed):
            session._finish(ev.reason)

    def _on_lost(self) -> None:
        if self.lost:
            return
        self.lost = True
        self._lost_event.set()
        for session in list(self.sessions.values()):
            log.warning("session %s: engine lost", session.id)
            with contextlib.suppress(asyncio.QueueFull):
                session.events.put_nowait(
                    p.SessionError(
                        session_id=session.id,
                        code=p.ErrorCode.ENGINE_LOST,
                        message="the engine process stopped; this session cannot continue",
                        fatal=True,
                    )
                )
            with contextlib.suppress(asyncio.QueueFull):
                session.events.put_nowait(
                    p.SessionClosed(session_id=session.id, reason=p.CloseReason.ENGINE_LOST)
                )
            session._finish(p.CloseReason.ENGINE_LOST)
        for stream in list(self.texts.values()):
            stream._deliver(
                p.TextDone(
                    request_id=stream.id,
                    finish_reason="error",
                    prompt_tokens=stream.started.prompt_tokens if stream.started else 0,
                    completion_tokens=0,
                    error="the engine process stopped",
                )
            )
