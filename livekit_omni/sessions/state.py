"""Where a dialect session stands in its life: an ordered :class:`SessionState` and the moves allowed between states.

This is the serving side's counterpart of the engine's ``ReplyPhase`` (docs/architecture.md, The reply lifecycle):
the state changes in exactly one place, :meth:`livekit_omni.sessions.base.DialectSession.advance`, which checks the
move against :data:`TRANSITIONS` and refuses an illegal one with :class:`IllegalTransition`. (The engine session's
own activity — listening, thinking, speaking — is ``engine_bridge.protocol.SessionState``; this one is the client
connection's lifecycle around it.)

::

    NEW ──> OPENING ──> ACTIVE ──> CLOSING ──> CLOSED
     │         │                      ^
     │         └──────────────────────┤         (an engine refusal ends the session before it started)
     └────────────────────────────────┤         (a session that never opened an engine session ends)
     └──────────────────────────────────────> CLOSED   (refused before anything was held: bad key, draining,
                                                        a resume that handed the connection to another session)
"""

from __future__ import annotations

import enum
from typing import Final


class SessionState(enum.IntEnum):
    """Ordered: everything at or past ``CLOSING`` is ending, so :attr:`ending` is one comparison."""

    #: Created: the client may configure it (Realtime) or must start it (Live); no engine session yet.
    NEW = 0
    #: The engine session is being opened.
    OPENING = 1
    #: The engine session is open and the session's clocks run (housekeeping, output, lifetime).
    ACTIVE = 2
    #: Ending: its last events go out, then the transport and the engine session close. Nothing new starts.
    CLOSING = 3
    #: Over: nothing more is sent.
    CLOSED = 4

    @property
    def ending(self) -> bool:
        return self >= SessionState.CLOSING


TRANSITIONS: Final[dict[SessionState, frozenset[SessionState]]] = {
    SessionState.NEW: frozenset({SessionState.OPENING, SessionState.CLOSING, SessionState.CLOSED}),
    SessionState.OPENING: frozenset({SessionState.ACTIVE, SessionState.CLOSING}),
    SessionState.ACTIVE: frozenset({SessionState.CLOSING}),
    SessionState.CLOSING: frozenset({SessionState.CLOSED}),
    SessionState.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    def __init__(self, session_id: str, current: SessionState, to: SessionState) -> None:
        super().__init__(f"session {session_id}: {current.name} -> {to.name} is not a legal move")
        self.current = current
        self.to = to
