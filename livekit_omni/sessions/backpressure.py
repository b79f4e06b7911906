"""Input backpressure for a facade session of either dialect: a leaky bucket of accepted caller audio.

The bucket drains at real time and holds at most ``burst_s`` (a start-up backlog, a burst after a stall). Audio that
does not fit is dropped, never queued. The first drop of an episode is reported to the client once; dropping that
goes on past ``grace_s`` ends the session (close 1013). An episode is over once the bucket has drained below half.
"""

from __future__ import annotations

import enum


class InputVerdict(enum.Enum):
    #: The audio fits: write it.
    ADMIT = "admit"
    #: Dropped, and the first drop of an episode: tell the client.
    DROP_AND_WARN = "drop_and_warn"
    #: Dropped (the client was told).
    DROP = "drop"
    #: Dropped past the grace period: end the session.
    CLOSE = "close"


class InputBudget:
    def __init__(self, *, burst_s: float, grace_s: float, now: float) -> None:
        if burst_s <= 0 or grace_s <= 0:
            raise ValueError("burst_s and grace_s must be positive")
        self.burst_s = burst_s
        self.grace_s = grace_s
        self._backlog_s = 0.0
        self._at = now
        self._over_since: float | None = None

    def reset(self, now: float) -> None:
        """Start the bucket's clock (the session's start); the bucket is empty."""
        self._backlog_s, self._at, self._over_since = 0.0, now, None

    def admit(self, seconds: float, now: float) -> InputVerdict:
        backlog = max(0.0, self._backlog_s - (now - self._at))
        self._at = now
        if backlog + seconds <= self.burst_s:
            self._backlog_s = backlog + seconds
            if self._over_since is not None and self._backlog_s < self.burst_s / 2:
                self._over_since = None  # drained with margin: the episode is over, a new one warns again
            return InputVerdict.ADMIT
        self._backlog_s = backlog
        if self._over_since is None:
            self._over_since = now
            return InputVerdict.DROP_AND_WARN
        return InputVerdict.CLOSE if now - self._over_since > self.grace_s else InputVerdict.DROP

    def message(self) -> str:
        return (
            f"input audio is arriving faster than real time (more than {self.burst_s:g} s ahead); the excess is "
            f"dropped, and the session closes if this persists for {self.grace_s:g} s"
        )
