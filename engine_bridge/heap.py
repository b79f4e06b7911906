"""The engine process's C heap: the memory a long session frees goes back to the system, at idle moments.

Why: glibc's malloc raises its mmap threshold each time a large ``mmap``-ed block is freed (up to 32 MiB on
64-bit), after which MB-sized buffers come from the heap, and a heap gives back only its top. The torch backend
allocates many MB-sized buffers of varying size (a session's KV grows, a generation group is merged and split, a
trimmed context is prefilled again), and the holes they leave between live blocks stay resident. In a 200-round
in-process soak of 6 conversations (one thread, the default 135M model) the heap's free part grew from 10 MiB to
150-850 MiB on top of the KV itself, so the RSS swung by hundreds of MiB from one minute to the next and drifted
up over the run.

``malloc_trim(0)`` returns the free pages inside the heap as well as its top (``madvise(MADV_DONTNEED)``), for
every arena. In the same soak, called after every round (about 5 s), it kept RSS minus KV flat to the MiB over
70 rounds (1490 MiB throughout, against 1512 -> 2020 MiB without), at 3-10 % of the run's time: the pages it gives
back are faulted in again when reused. A call took 7-36 ms, once 120 ms, with 6 sessions of context. Hence a
trim every 30 s by default, not after every turn; ctypes releases the GIL for the call, so the audio thread runs. The alternative, a fixed
``M_MMAP_THRESHOLD`` (every large buffer its own mapping, given back on ``free``), kept the RSS as flat but made
the same soak about 60 % slower on this VM: the forward passes' large temporaries were faulted in afresh every
time.

The engine's scheduler thread calls :meth:`HeapTrimmer.maybe_trim` when a tick found no work, so a trim never
delays a forward pass of its own thread; a scheduler that is never idle still trims once every
``max_interval_s`` (4 intervals unless told). Only glibc has ``malloc_trim``; elsewhere (musl, macOS) the trimmer
does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger(__name__)


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


class HeapTrimmer:
    """Gives the C heap's free pages back to the system, at most once per ``interval_s``, at idle ticks.

    ``interval_s`` 0 turns it off. Counters (``trims``, ``released``, ``last_ms``, ``max_ms``) are for ``/health``.
    """

    def __init__(self, interval_s: float, *, max_interval_s: float | None = None) -> None:
        longest = 4 * interval_s if max_interval_s is None else max_interval_s
        if interval_s < 0 or longest < interval_s:
            raise ValueError(f"heap trim intervals must be 0 <= interval <= max, not {interval_s}, {longest}")
        self.interval_s = interval_s
        self.max_interval_s = longest
        self._libc = _glibc() if interval_s > 0 else None
        if interval_s > 0 and self._libc is None:
            log.info("not glibc: the C heap is not trimmed")
        self._last = time.monotonic()
        self._lock = threading.Lock()
        self.trims = 0
        #: Trims that gave memory back (malloc_trim returned 1).
        self.released = 0
        self.last_ms = 0.0
        self.max_ms = 0.0

    @property
    def enabled(self) -> bool:
        return self._libc is not None

    def maybe_trim(self, *, idle: bool, now: float | None = None) -> bool:
        """Trim when the interval has passed and the caller is idle, or when ``max_interval_s`` has passed."""
        if self._libc is None:
            return False
        now = time.monotonic() if now is None else now
        since = now - self._last
        if since < self.interval_s or (not idle and since < self.max_interval_s):
            return False
        self.trim()
        return True

    def trim(self) -> bool:
        """Trim now; returns True when memory went back to the system."""
        if self._libc is None:
            return False
        with self._lock:
            t0 = time.perf_counter()
            gave_back = bool(self._libc.malloc_trim(0))
            ms = (time.perf_counter() - t0) * 1000
            self._last = time.monotonic()
            self.trims += 1
            self.released += gave_back
            self.last_ms = ms
            self.max_ms = max(self.max_ms, ms)
        return gave_back

    def describe(self) -> dict[str, object]:
        return {
            "enabled": self.enabled,
            "interval_s": self.interval_s,
            "trims": self.trims,
            "released": self.released,
            "last_ms": round(self.last_ms, 2),
            "max_ms": round(self.max_ms, 2),
        }
