"""An asyncio frame clock: one tick every 20 ms on absolute deadlines.

Deadlines are ``start + k × interval``, never "now + interval", so scheduling jitter does not accumulate into drift.
A tick that comes late (the loop was busy) returns at once, so the clock catches up by running the next ticks
back to back; a stall longer than ``max_catchup`` ticks is not replayed as a burst (a receiver would only drop the
flood), the clock jumps ahead instead and counts the ticks it skipped. Waiting is ``asyncio.sleep``, never a
blocking call.

A tick may also be released early, by :meth:`Pacer.nudge`, up to ``early_s`` before its deadline. That is for a
consumer whose loop wakes up anyway for another periodic reason (the co-located LiveKit plugin: the caller's
frames arrive every 20 ms): producing the output frame in that wake-up instead of the pacer's own saves one
wake-up of the process per frame, which on a virtual machine costs more than the frame's work itself (the caches
are cold after every sleep). The grid is unchanged, so early ticks never accumulate: on average still exactly one
tick per interval, each at most ``early_s`` ahead of its deadline, and a consumer that stops nudging (the caller
went silent) falls back to the timer on the same grid.
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
        early_s: float = 0.0,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("pacer interval must be positive")
        if not 0 <= early_s <= interval_s:
            raise ValueError("a tick can be released at most one interval early")
        self.interval_s = interval_s
        self.early_s = early_s
        self.max_catchup = max_catchup
        self._clock = clock
        self._start: float | None = None
        self._k = 0
        # The pending tick's wait (when early release is on): its future and deadline.
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_for = 0.0
        #: Ticks delivered, ticks that were already past their deadline, ticks skipped after a long stall, ticks
        #: released early by a nudge.
        self.ticks = 0
        self.late = 0
        self.skipped = 0
        self.early = 0

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
            if self.early_s > 0:
                await self._wait(deadline, now)
            else:
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

    def nudge(self) -> bool:
        """Release the pending tick now if its deadline is at most ``early_s`` away; True if it was released.
        Costs a clock read when nothing is due; safe to call at any time, from the loop's thread."""
        waiter = self._waiter
        if waiter is None or waiter.done() or self._clock() < self._waiting_for - self.early_s:
            return False
        waiter.set_result(None)
        self.early += 1
        return True

    async def _wait(self, deadline: float, now: float) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(deadline - now, _release, waiter)
        self._waiter = waiter
        self._waiting_for = deadline
        try:
            await waiter
        finally:
            # A nudged tick leaves its timer behind: cancelled, it never wakes the loop (asyncio drops cancelled
            # timers from the head of its queue before it computes how long to sleep).
            timer.cancel()
            self._waiter = None

    async def __aiter__(self) -> AsyncIterator[float]:
        while True:
            yield await self.tick()


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
