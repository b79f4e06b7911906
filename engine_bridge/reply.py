"""Where an assistant reply stands: its ordered phases, the transitions between them, and the snapshot of it
that the audio thread reads.

A reply moves forward through the phases and never back. The order carries meaning, as in a request status
enum of an inference engine: a speculative phase sorts before every audible one, and every finished phase
after them, so ``is_finished`` is one comparison::

    NEW ─┬─> SPECULATIVE ──> HELD ─────────┐            (before the caller's endpoint: audio held back)
         │        │                        │ endpoint
         │        │ endpoint               v
         └──────> GENERATING ───────> VOICING ───> DRAINING ───> DONE
                     │                   │            │
                     └───────────────────┴────────────┴──> INTERRUPTED    (barge-in, client interrupt)
    SPECULATIVE..DRAINING ──> CANCELLED                                   (dropped unheard, session closed)

The one object that owns a reply (the cascade's :class:`~engine_bridge.adapters.cascade.reply.Reply`) changes
its phase only through a transition checked against :data:`TRANSITIONS`, and publishes a
:class:`ReplySnapshot` on the session at each one. The audio thread reads that snapshot (one attribute read of an
immutable object) to decide whether caller speech overlaps model speech.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class ReplyPhase(enum.IntEnum):
    #: Built, not started yet (the owner starts it at once, speculatively or confirmed).
    NEW = 0
    #: Generating before the caller's endpoint: its audio is held back, it is not audible, and the caller
    #: speaking again throws it away without an event.
    SPECULATIVE = 1
    #: Generation finished before the endpoint; the voiced audio waits for it.
    HELD = 2
    #: Confirmed (announced with ``ReplyStarted``): the thinker produces tokens, TTS voices clauses as they come.
    GENERATING = 3
    #: Generation over; TTS still voices the last clauses.
    VOICING = 4
    #: All its audio is produced; it is waiting for that audio to leave the engine.
    DRAINING = 5
    #: Played out (``ReplyDone(interrupted=False)``).
    DONE = 6
    #: Cut by a barge-in or a client interrupt (``ReplyDone(interrupted=True)``, after ``BargeIn`` for a barge-in).
    INTERRUPTED = 7
    #: Dropped without ever being announced (a discarded speculation), or its session closed: no event.
    CANCELLED = 8

    @property
    def is_speculative(self) -> bool:
        """Not announced yet: its audio is held and the caller resuming discards it."""
        return self <= ReplyPhase.HELD

    @property
    def is_confirmed(self) -> bool:
        """Announced and not finished: the caller hears it (or is about to)."""
        return ReplyPhase.GENERATING <= self <= ReplyPhase.DRAINING

    @property
    def is_generating(self) -> bool:
        """The thinker is producing its tokens (the scheduler steps it)."""
        return self in (ReplyPhase.SPECULATIVE, ReplyPhase.GENERATING)

    @property
    def is_producing(self) -> bool:
        """Confirmed, and its audio is still being produced (tokens or TTS): audible even with empty queues."""
        return ReplyPhase.GENERATING <= self <= ReplyPhase.VOICING

    @property
    def is_finished(self) -> bool:
        return self >= ReplyPhase.DONE


_P = ReplyPhase

#: Every legal transition. A phase missing on the right of its row cannot be reached from it.
TRANSITIONS: Final[dict[ReplyPhase, frozenset[ReplyPhase]]] = {
    _P.NEW: frozenset({_P.SPECULATIVE, _P.GENERATING}),
    _P.SPECULATIVE: frozenset({_P.HELD, _P.GENERATING, _P.CANCELLED}),
    _P.HELD: frozenset({_P.VOICING, _P.CANCELLED}),
    _P.GENERATING: frozenset({_P.VOICING, _P.INTERRUPTED, _P.CANCELLED}),
    _P.VOICING: frozenset({_P.DRAINING, _P.INTERRUPTED, _P.CANCELLED}),
    _P.DRAINING: frozenset({_P.DONE, _P.INTERRUPTED, _P.CANCELLED}),
    _P.DONE: frozenset(),
    _P.INTERRUPTED: frozenset(),
    _P.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A reply was asked to move to a phase its current phase does not lead to (a bug in the turn machine)."""

    def __init__(self, turn_id: int, current: ReplyPhase, target: ReplyPhase) -> None:
        super().__init__(f"reply {turn_id}: {current.name} -> {target.name} is not a legal transition")
        self.turn_id = turn_id
        self.current = current
        self.target = target


def check_transition(turn_id: int, current: ReplyPhase, target: ReplyPhase) -> None:
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(turn_id, current, target)


@dataclass(frozen=True, slots=True)
class ReplySnapshot:
    """The latest reply of a session as its owner last published it. Immutable, replaced whole at each
    transition, so a reader on another thread sees a turn id and a phase that belong together."""

    turn_id: int
    epoch: int
    phase: ReplyPhase


#: The sentinel a session holds before its first reply: finished, never audible.
NO_REPLY: Final = ReplySnapshot(turn_id=0, epoch=0, phase=ReplyPhase.CANCELLED)
