"""Session resume: what keeps a session alive between a dropped connection and the client's return.

A session whose transport drops without ``session.close`` is *detached*: its engine session (KV, conversation,
timeline) keeps running, and what it would have sent goes into a :class:`DetachedTransport`, a bounded buffer.
A new connection that presents the session's resume token (``session.resume`` on the WebSocket, ``resume_token``
in a WebRTC offer) takes the session over; the buffer is replayed to it first. Tokens are single use and live in
one :class:`ResumeTokens` registry in the process that holds the engine sessions (docs/protocol.md, "Resume").
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Final, Generic, TypeVar

from livekit_omni import worker_ids
from livekit_omni.sessions.errors import WireError

#: Spent tokens remembered, so that a second use is told apart from a wrong token (oldest forgotten first).
SPENT_TOKENS_KEPT: Final = 10_000
#: Resume refusals (``error.code``; the connection stays usable for a ``session.start``).
TOKEN_USED: Final = "resume_token_used"
TOKEN_INVALID: Final = "resume_token_invalid"
TRANSPORT_MISMATCH: Final = "resume_transport_mismatch"
REFUSALS: Final = frozenset({TOKEN_USED, TOKEN_INVALID, TRANSPORT_MISMATCH})

S = TypeVar("S")


class ResumeTokens(Generic[S]):
    """Token -> the session it resumes. Each token is good for one resume; the session then gets a fresh one."""

    def __init__(self) -> None:
        self._live: dict[str, S] = {}
        self._spent: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def issue(self, session: S) -> str:
        token = worker_ids.tagged(secrets.token_urlsafe(24))
        self._live[token] = session
        return token

    def peek(self, token: str) -> S | None:
        """The session of ``token`` if it is live, without spending it."""
        return self._live.get(token)

    def take(self, token: str) -> S:
        """The session of ``token``, which is spent by this call. Raises :class:`WireError`:
        ``resume_token_used`` for a token already taken, ``resume_token_invalid`` for one never issued or whose
        session has ended (its grace ran out, it overflowed, it was closed)."""
        session = self._live.pop(token, None)
        if session is None:
            if token in self._spent:
                raise WireError(
                    TOKEN_USED,
                    "this resume token was already used; a token resumes a session once "
                    "(the session.started of that resume carried the next one)",
                    param="resume_token",
                )
            raise WireError(
                TOKEN_INVALID,
                "no session to resume with this token (unknown, or the session has ended); "
                "send session.start for a new session",
                param="resume_token",
            )
        self._spent[token] = None
        while len(self._spent) > SPENT_TOKENS_KEPT:
            self._spent.popitem(last=False)
        return session

    def revoke(self, token: str) -> None:
        """The session ended: its token resumes nothing any more."""
        self._live.pop(token, None)


class DetachedTransport:
    """Stands in for a dropped connection: keeps the encoded events the session sends, up to ``max_events`` and
    ``max_bytes``. Past either, it keeps nothing more and calls ``on_overflow`` once (the session is then closed:
    a client that resumed would have missed output, which the protocol never does silently)."""

    def __init__(
        self,
        *,
        kind: str,
        carries_audio: bool,
        max_events: int,
        max_bytes: int,
        on_overflow: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.carries_audio = carries_audio
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self.overflowed = False
        self._on_overflow = on_overflow

    def send(self, data: bytes) -> None:
        if self.overflowed:
            return
        if len(self.pending) >= self.max_events or self.pending_bytes + len(data) > self.max_bytes:
            self.overflowed = True
            self.pending.clear()
            self.pending_bytes = 0
            self._on_overflow()
            return
        self.pending.append(data)
        self.pending_bytes += len(data)

    def pop(self) -> bytes:
        data = self.pending.popleft()
        self.pending_bytes -= len(data)
        return data

    async def put(self, data: bytes) -> None:
        self.send(data)

    async def close(self, code: int, reason: str = "") -> None:
        """Nobody is connected: there is nothing to close."""
