"""A duplex session as the engine sees it: state, epoch, turns, the conversation log, and its outbox.

Ownership (one owner per piece of state, so no state needs a lock except the epoch fence):
* the **scheduler thread** owns everything the model adapter touches: state, turn ids, the conversation log,
  generation. It drains the session's ordered mailbox; nothing else mutates these.
* the **audio thread** owns the ring cursors and the turn detector: it reads ingress, detects speech, writes the
  outbox into egress, and on barge-in bumps the epoch word in the ring header *first*.
* the epoch fence (`epoch` + outbox clear) is the only state both threads change; `fence_lock` guards it.
* where the current reply stands is owned by one reply object on the scheduler thread; every other thread reads
  the immutable :class:`~engine_bridge.reply.ReplySnapshot` it publishes in ``reply`` (one attribute read).
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np

from engine_bridge import protocol as p
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, samples_to_ms
from engine_bridge.reply import NO_REPLY, ReplyPhase, ReplySnapshot
from engine_bridge.ring import RingPair

log = logging.getLogger(__name__)

EmitFn = Callable[[p.SessionEvent], None]


class Role(enum.StrEnum):
    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"
    #: A function tool's result (``Segment.call_id`` names the call).
    TOOL = "tool"


@dataclass(slots=True)
class Segment:
    """One entry of the authoritative conversation log.

    ``audio_start_ms``/``audio_end_ms`` place it on the session timeline (input timeline for the caller, reply
    samples for the model); ``token_start``/``token_end`` place it in the thinker's token log when there is one.
    """

    role: Role
    text: str
    epoch: int
    turn_id: int = 0
    audio_start_ms: int = 0
    audio_end_ms: int = 0
    token_start: int = 0
    token_end: int = 0
    interrupted: bool = False
    #: An assistant segment that ended in a function call: the call (``text`` is what was said before it).
    tool_call: p.ToolCallItem | None = None
    #: A tool segment: the call whose result it is.
    call_id: str = ""


@dataclass(slots=True)
class Checkpoint:
    """Where the conversation stood before a reply: log length and (for a thinker) token position."""

    log_len: int
    token_pos: int
    epoch: int


@dataclass(slots=True)
class OutChunk:
    epoch: int
    turn_id: int
    seq: int
    pcm: np.ndarray


class WrittenAudio(NamedTuple):
    """Samples of reply ``turn_id`` moved into the egress ring so far: the playout estimate when the media side
    reports none. The audio thread replaces it whole at each write, so a reader never sees a torn pair."""

    turn_id: int
    samples: int


class AdapterState:
    """Base of the per-session state a model adapter keeps in :attr:`DuplexSession.adapter_state` (set by its
    ``open``, dropped at close). Each adapter subclasses it and narrows it back with ``isinstance``."""

    __slots__ = ()


@dataclass(slots=True)
class SessionStats:
    opened_at: float = field(default_factory=time.monotonic)
    input_samples: int = 0
    output_samples: int = 0
    turns: int = 0
    barge_ins: int = 0
    ignored_short_speech: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class DuplexSession:
    def __init__(
        self,
        session_id: str,
        rings: RingPair,
        config: p.SessionConfig,
        emit: EmitFn,
        *,
        owner_id: int,
        idle_ttl_s: float,
    ) -> None:
        self.id = session_id
        self.rings = rings
        self.config = config
        self._emit = emit
        self.owner_id = owner_id
        self.idle_ttl_s = idle_ttl_s
        self.state = p.SessionState.LISTENING
        self.epoch = rings.egress.epoch
        self.turn_id = 0
        self.muted = False
        self.log: list[Segment] = []
        self.mailbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: collections.deque[OutChunk] = collections.deque()
        self.fence_lock = threading.Lock()
        self.stats = SessionStats()
        self.last_activity = time.monotonic()
        self.closing = False
        self.close_reason: p.CloseReason | None = None
        #: Adapter-private state (e.g. the cascade's turn machine state); set by the adapter's ``open``.
        self.adapter_state: AdapterState | None = None
        #: The latest reply, as its owner (the adapter, on the scheduler thread) published it at its last phase
        #: transition. Replaced whole, never mutated: the audio thread reads it once per decision.
        self.reply: ReplySnapshot = NO_REPLY
        #: What has been written to egress of the latest reply (see :class:`WrittenAudio`).
        self.written = WrittenAudio(0, 0)
        #: Called (from whichever thread queued it) when reply audio lands in the outbox, so the engine's audio
        #: thread moves it into egress now rather than at its next fallback wake-up.
        self.on_output: Callable[[], None] | None = None
        #: Called after every :meth:`post` (from whichever thread posted), so the scheduler thread handles the
        #: message now rather than at its next idle poll, however long an adapter makes that poll.
        self.on_post: Callable[[], None] | None = None

    # --- timeline -------------------------------------------------------------------------------------------
    @property
    def input_ms(self) -> int:
        return samples_to_ms(self.stats.input_samples, ENGINE_INPUT_RATE)

    @property
    def output_ms(self) -> int:
        return samples_to_ms(self.stats.output_samples, ENGINE_OUTPUT_RATE)

    # --- events ---------------------------------------------------------------------------------------------
    def emit(self, ev: p.SessionEvent) -> None:
        self._emit(ev)

    def set_state(self, state: p.SessionState) -> None:
        if state is not self.state:
            self.state = state
            self.emit(p.StateChanged(session_id=self.id, state=state, at_ms=self.input_ms))

    def post(self, msg: Any) -> None:
        """Queue a message for the scheduler thread (the session's single owner) and wake it."""
        self.mailbox.put(msg)
        if self.on_post is not None:
            self.on_post()

    def apply_update(self, cmd: p.UpdateSession) -> None:
        """``UpdateSession``: the configuration takes the update's set fields (a new struct, so a reader on another
        thread sees the old one or the new one, never a mix), and the owner applies them in mailbox order."""
        changes: dict[str, Any] = {
            name: getattr(cmd, name)
            for name in (
                "instructions",
                "voice",
                "turn_taking",
                "temperature",
                "max_output_tokens",
                "tools",
                "tool_choice",
                "acknowledgement_delay_ms",
            )
            if getattr(cmd, name) is not None
        }
        self.config = msgspec.structs.replace(self.config, **changes)
        self.post(SettingsChange(cmd))

    def model_audible(self) -> bool:
        """Model speech is being produced, queued, or in the egress ring (the audio thread's barge-in test)."""
        reply = self.reply  # one read: the phase belongs to one transition
        if reply.phase.is_producing:
            return True
        if reply.phase is not ReplyPhase.DRAINING:
            return False
        eg = self.rings.egress
        return bool(self.outbox) or eg.write_cursor > eg.read_cursor

    # --- the epoch fence ------------------------------------------------------------------------------------
    def bump_epoch(self) -> int:
        """Make every queued and in-flight output stale. The ring word goes first, so the media plane drops stale
        audio at its next frame even before this thread clears its own outbox."""
        with self.fence_lock:
            self.epoch = self.rings.egress.bump_epoch()
            self.outbox.clear()
            return self.epoch

    def queue_audio(self, epoch: int, turn_id: int, seq: int, pcm: np.ndarray) -> bool:
        """Queue reply audio for egress; False (dropped) if its epoch is already stale. The audio thread moves it
        into the egress ring at its next pass (``on_output`` wakes it)."""
        with self.fence_lock:
            if epoch != self.epoch:
                return False
            self.outbox.append(OutChunk(epoch, turn_id, seq, pcm))
        if self.on_output is not None:
            self.on_output()
        return True

    def write_audio(self, epoch: int, turn_id: int, seq: int, pcm: np.ndarray) -> bool:
        """Reply audio straight into the egress ring from the calling thread, behind whatever the outbox still
        holds; False (dropped) if its epoch is already stale. For an adapter whose audio arrives on a thread of its
        own (the vLLM-Omni bridge's loop): it saves the hand-off to the audio thread (a doorbell syscall and a
        wake-up per piece, two of the unit's scheduling hops). What does not fit waits in the outbox, and the
        audio thread is woken to retry it."""
        with self.fence_lock:
            if epoch != self.epoch:
                return False
            self.outbox.append(OutChunk(epoch, turn_id, seq, pcm))
            backlog = self._drain_outbox_locked()
        if backlog and self.on_output is not None:
            self.on_output()
        return True

    def drain_outbox(self) -> bool:
        """Move queued reply audio into the egress ring; True if some is still queued (the ring is full)."""
        with self.fence_lock:
            return self._drain_outbox_locked()

    def _drain_outbox_locked(self) -> bool:
        # The egress ring has one producer at a time: every write happens here, under ``fence_lock``.
        egress = self.rings.egress
        while self.outbox:
            c = self.outbox[0]
            if not egress.write_chunk(c.epoch, c.turn_id, c.seq, c.pcm):
                return True  # the media side has not made room yet
            self.outbox.popleft()
            n_out = c.pcm.shape[0]
            self.stats.output_samples += n_out
            w = self.written
            self.written = WrittenAudio(c.turn_id, (w.samples if w.turn_id == c.turn_id else 0) + n_out)
        return False

    def snapshot(self) -> dict[str, Any]:
        st = self.stats
        cfg = self.config
        played_epoch, played_turn, played = self.rings.egress.playout()
        return {
            "session_id": self.id,
            "state": self.state,
            "epoch": self.epoch,
            "turn_id": self.turn_id,
            "input_seconds": st.input_samples / ENGINE_INPUT_RATE,
            "output_seconds": st.output_samples / ENGINE_OUTPUT_RATE,
            "turns": st.turns,
            "barge_ins": st.barge_ins,
            "ignored_short_speech": st.ignored_short_speech,
            "ingress_overruns": self.rings.ingress.overruns,
            "egress_overruns": self.rings.egress.overruns,
            "stale_dropped": self.rings.egress.stale_dropped,
            "playout": {"epoch": played_epoch, "turn_id": played_turn, "samples": played},
            # The settings as the client last set them (OpenSession, then UpdateSession); what the adapter made of
            # them, where it reports it, is in its own counters.
            "config": {
                "voice": cfg.voice,
                "instructions": cfg.instructions,
                "temperature": cfg.temperature,
                "max_output_tokens": cfg.max_output_tokens,
                "turn_taking": msgspec.structs.asdict(cfg.turn_taking),
            },
            "log": [
                {
                    "role": str(s.role),
                    "text": s.text,
                    "epoch": s.epoch,
                    "turn_id": s.turn_id,
                    "audio_start_ms": s.audio_start_ms,
                    "audio_end_ms": s.audio_end_ms,
                    "token_start": s.token_start,
                    "token_end": s.token_end,
                    "interrupted": s.interrupted,
                }
                for s in self.log
            ],
            **st.extra,
        }


# --- mailbox messages posted by the engine core (the adapter defines its own for audio-thread events) ----------


@dataclass(frozen=True, slots=True)
class TextAppend:
    kind: str  # a protocol AppendKind
    text: str
    at_ms: int
    #: ``respond``: the reply's own token cap (0: the session's).
    max_output_tokens: int = 0
    #: ``respond``: the reply's own tool choice (None: the session's).
    tool_choice: p.ToolChoiceSpec | None = None
    #: ``tool_result``: the call it answers; ``tool_call``: the call.
    call_id: str = ""
    call: p.ToolCallItem | None = None


@dataclass(frozen=True, slots=True)
class InterruptRequest:
    """The client stopped model speech (the epoch was already bumped by the engine core)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class TruncateRequest:
    """Keep only ``text`` of finished reply ``turn_id`` in the conversation (``TruncateReply``)."""

    turn_id: int
    text: str


@dataclass(frozen=True, slots=True)
class SettingsChange:
    """``UpdateSession``: the engine core already merged it into ``DuplexSession.config``; the adapter applies
    what changed (the fields that are not None)."""

    update: p.UpdateSession


@dataclass(frozen=True, slots=True)
class MuteChange:
    muted: bool
