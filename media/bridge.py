"""The bridge between one open engine session and whoever carries it to a caller.

Every consumer of an engine session needs the same four things: an :class:`~media.ingress.IngressWriter` for the
caller's audio, an :class:`~media.egress.EgressPlayer` for the model's, a task that drains the session's event
queue, and a keep-alive so the engine does not reap a session whose caller is merely quiet. :class:`SessionBridge`
owns all four; every dialect session (``livekit_omni.sessions.base``, WebSocket and WebRTC alike) and the co-located
LiveKit plugin (``livekit_omni.plugin.colocated``) each hold one and differ only in what they do with the events.

Events: the pump hands each :class:`~engine_bridge.protocol.OutputTranscript` to the player first (it releases
the text with the frame that plays it), then passes every event, in order and including the final
:class:`~engine_bridge.protocol.SessionClosed`, to the consumer's ``on_event``. A handler that raises is logged
and the pump goes on.

Keep-alive, one rule for every transport: the engine reaps a session after ``idle_ttl_s`` without activity, and
caller audio it reads counts as activity. So every quarter of the session's idle TTL (at least 1 s) the bridge
looks at its ingress writer: if no caller audio reached the ring since the last look (a muted track that stopped
sending, a WebSocket client that sends none), it touches the session; otherwise the audio already kept it alive.
The TTL is the one the engine reported when it opened the session.

The bridge is also a :class:`~media.ingress.SessionLike`, so media primitives that take a session (e.g.
:func:`media.webrtc.answer_offer`) can take the bridge and use its writer and player instead of making their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from engine_bridge import protocol as p
from engine_bridge.client import EngineSession
from engine_bridge.control import ControlError
from engine_bridge.ring import RingPair
from media.codecs import AudioEncoding
from media.egress import EgressPlayer
from media.ingress import IngressWriter

log = logging.getLogger(__name__)

#: The keep-alive looks at the session at least this often, whatever its TTL.
MIN_KEEPALIVE_S: Final = 1.0
#: A touch that gets no answer within this is given up (the next look tries again).
TOUCH_TIMEOUT_S: Final = 5.0

EventHandler = Callable[[p.SessionEvent], None]


def keepalive_interval(idle_ttl_s: float) -> float:
    """How often the bridge looks at a session with this idle TTL: a quarter of it, at least 1 s."""
    return max(MIN_KEEPALIVE_S, idle_ttl_s / 4)


class SessionBridge:
    """One engine session's media and events: ingress writer, egress player, event pump and keep-alive.

    Create it when the engine session is open, :meth:`open_output` once the output format is known, :meth:`start`
    when the consumer is ready for events, and :meth:`close` at the end (which also closes the engine session).
    """

    def __init__(self, session: EngineSession, on_event: EventHandler) -> None:
        self.session = session
        self._on_event = on_event
        #: Caller audio into the ingress ring (PCM16 at the engine rate until :meth:`IngressWriter.set_format`).
        self.writer = IngressWriter(session)
        #: Model audio out of the egress ring, once :meth:`open_output` made it.
        self.player: EgressPlayer | None = None
        self.touches = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # --- SessionLike: what media primitives need of a session ------------------------------------------------
    @property
    def rings(self) -> RingPair:
        return self.session.rings

    @property
    def closed(self) -> bool:
        return self._closed or self.session.closed

    def ring_doorbell(self) -> None:
        self.session.ring_doorbell()

    # --- life ------------------------------------------------------------------------------------------------
    def open_output(self, *, rate: int, encoding: AudioEncoding | str = AudioEncoding.PCM16) -> EgressPlayer:
        """Make the egress player at the consumer's output rate and encoding (once)."""
        if self.player is not None:
            raise RuntimeError("the bridge's output is already open")
        self.player = EgressPlayer(self.session, rate=rate, encoding=encoding)
        return self.player

    def output_at(self, rate: int) -> EgressPlayer:
        """The PCM16 player at ``rate``: the open one when it plays at that rate (a new WebRTC peer taking the
        session over keeps its output where it was), else a new one (the old one stops reading the ring first)."""
        player = self.player
        if player is not None and player.rate == rate and player.encoding is AudioEncoding.PCM16:
            return player
        if player is not None:
            player.close()
            self.player = None
        return self.open_output(rate=rate)

    def start(self) -> None:
        """Start the event pump and the keep-alive."""
        if self._tasks or self._closed:
            return
        sid = self.session.id
        self._tasks = [
            asyncio.create_task(self._pump(), name=f"bridge-events-{sid}"),
            asyncio.create_task(self._keepalive(), name=f"bridge-keepalive-{sid}"),
        ]

    async def close(self, reason: p.CloseReason = p.CloseReason.CLIENT) -> None:
        """Stop the tasks and the media (nothing touches the rings afterwards), then close the engine session.
        Idempotent; never raises."""
        if not self._closed:
            self._closed = True
            current = asyncio.current_task()
            for t in self._tasks:
                if t is not current:
                    t.cancel()
            for t in self._tasks:
                if t is not current:
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
            if self.player is not None:
                self.player.close()
            self.writer.close()
        await self.session.close(reason)

    async def wait(self) -> None:
        """Until the session's events end: the pump handled its SessionClosed (or the bridge was closed)."""
        if self._tasks:
            await asyncio.wait({self._tasks[0]})  # raises only when the waiter itself is cancelled

    # --- tasks -----------------------------------------------------------------------------------------------
    async def _pump(self) -> None:
        events = self.session.events
        while True:
            ev = await events.get()
            if isinstance(ev, p.OutputTranscript) and self.player is not None:
                self.player.add_transcript(ev)
            try:
                self._on_event(ev)
            except Exception:
                log.exception(
                    "session %s: handling engine event %s failed", self.session.id, type(ev).__name__
                )
            if isinstance(ev, p.SessionClosed):
                return

    async def _keepalive(self) -> None:
        session = self.session
        interval = keepalive_interval(session.idle_ttl_s)
        written = self.writer.samples_written
        while not self.closed:
            await asyncio.sleep(interval)
            if self.closed:
                return
            if self.writer.samples_written != written:
                written = self.writer.samples_written  # caller audio kept the session alive
                continue
            self.touches += 1
            with contextlib.suppress(ControlError, TimeoutError):
                await asyncio.wait_for(session.touch(), TOUCH_TIMEOUT_S)

    def stats(self) -> dict[str, object]:
        return {
            "touches": self.touches,
            "ingress": self.writer.stats(),
            "egress": self.player.stats() if self.player is not None else {},
        }

    def loss_counters(self) -> dict[str, int]:
        """What this session lost so far: ring overruns on either side (the ingress writer's drops, the engine's
        reply audio that found egress full, both from the ring header), output frames only partly filled, and
        output transcripts dropped on queue overflow. Zero once the rings are released."""
        rings = None if self.session.closed else self.session.rings
        egress = self.player.stats() if self.player is not None else {}
        return {
            "ingress_overruns": self.writer.overruns,
            "egress_overruns": rings.egress.overruns if rings is not None else 0,
            "egress_underruns": int(egress.get("underruns", 0)),
            "transcripts_overflow": int(egress.get("transcripts_overflow", 0)),
        }
