"""Graceful drain: what ``livekit-omni serve`` does on SIGTERM (``docker compose stop``, a Kubernetes rollout).

1. Admission stops at once: ``/health`` says ``draining`` (503, so a load balancer takes the server out), a new
   Live WebSocket gets ``error`` ``server_draining`` and close 1013 (try again: a client retries elsewhere), a
   WebRTC offer gets HTTP 503 ``server_draining``.
2. Open sessions go on, for up to ``drain_grace_s`` (default 30 s); the drain ends early once none is left.
3. Whatever is still open then ends the way every shutdown does: ``error`` ``server_shutdown``, ``session.closed``,
   close 1012 (docs/protocol.md). Then the server stops, exit code 0.

A second SIGTERM (or a SIGINT) during the drain cuts the grace short.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sized
from typing import Final

log = logging.getLogger(__name__)

#: How often the drain looks whether the last session has ended.
POLL_S: Final = 0.1
#: The error code a session refused during the drain gets.
DRAINING_CODE: Final = "server_draining"
DRAINING_MESSAGE: Final = "the server is draining (shutting down); start the session on another server"


class DrainStatus(enum.StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"


class Drain:
    """The server's admission state. ``begin`` is idempotent; ``run`` waits out the grace, then closes the rest."""

    def __init__(self, grace_s: float) -> None:
        if grace_s < 0:
            raise ValueError("drain grace must be >= 0")
        self.grace_s = grace_s
        self.status = DrainStatus.SERVING
        self.began_at: float | None = None
        self._cut_short = asyncio.Event()

    @property
    def admitting(self) -> bool:
        return self.status is DrainStatus.SERVING

    def begin(self) -> bool:
        """Stop admission. True the first time (the caller then runs :meth:`run`)."""
        if self.status is not DrainStatus.SERVING:
            return False
        self.status = DrainStatus.DRAINING
        self.began_at = time.monotonic()
        log.warning("draining: no new sessions; open ones get up to %g s", self.grace_s)
        return True

    def cut_short(self) -> None:
        """End the grace now (a second signal)."""
        self._cut_short.set()

    def remaining_s(self) -> float | None:
        if self.began_at is None:
            return None
        return max(0.0, self.grace_s - (time.monotonic() - self.began_at))

    async def run(self, sessions: Sized, close_all: Callable[[], Awaitable[None]]) -> int:
        """Wait until ``sessions`` is empty or the grace is over, then ``close_all``. Returns how many were closed."""
        self.begin()
        assert self.began_at is not None
        deadline = self.began_at + self.grace_s
        while len(sessions) and not self._cut_short.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._cut_short.wait(), min(POLL_S, left))
            except TimeoutError:
                pass
        closed = len(sessions)
        if closed:
            log.warning("drain grace over: closing %d open session(s)", closed)
            await close_all()
        self.status = DrainStatus.DRAINED
        log.info("drained in %.1f s", time.monotonic() - self.began_at)
        return closed
