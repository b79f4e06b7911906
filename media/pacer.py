"""An asyncio frame clock: one tick every 20 ms on absolute deadlines.

Deadlines are ``start + k × interval``, never "now + interval", so scheduling jitter does not accumulate into drift.
A tick that comes late (the loop was busy) returns at once, so the clock catches up by running the next ticks
back to back; a stall longer than ``max_catchup`` ticks is not replayed as a burst (a receiver would only drop the
flood), the clock jumps ahead instead and counts the ticks it skipped. Waiting is ``asyncio.sleep``, never a
blocking call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Final

from engine_bridge.formats import FRAME_MS

DEFAULT_INTERVAL_S: Final = FRAME_MS / 1000


class Pacer:
    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        max_catchup: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("pacer interval must be positive")
        self.interval_s = interval_s
        self.max_catchup = max_catchup
        self._clock = clock
        self._start: float | None = None
        self._k = 0
        #: Ticks delivered, ticks that were already past their deadline, ticks skipped after a long stall.
        self.ticks = 0
        self.late = 0
        self.skipped = 0

    @property
    def next_deadline(self) -> float | None:
        return None if self._start is None else self._start + self._k * self.interval_s

    def reset(self) -> None:
        """Restart the clock: the next tick fires immediately."""
        self._start = None
        self._k = 0

    async def tick(self) -> float:
        """Wait for the next deadline; returns it (on the pacer's clock). The first tick fires immediately."""
        now = self._clock()
        if self._start is None:
            self._start = now
            self._k = 0
        deadline = self._start + self._k * self.interval_s
        if now < deadline:
            await asyncio.sleep(deadline - now)
        else:
            behind = int((now - deadline) / self.interval_s)
            if behind > self.max_catchup:
                # Give up on the backlog: restart the grid at the current slot.
                self._k += behind
                self.skipped += behind
                deadline = self._start + self._k * self.interval_s
            if now - deadline > self.interval_s / 2:
                self.late += 1
        self._k += 1
        self.ticks += 1
        return deadline

    async def __aiter__(self) -> AsyncIterator[float]:
        while True:
            yield await self.tick()
