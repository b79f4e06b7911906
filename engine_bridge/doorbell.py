"""A doorbell to the engine's audio thread: a named FIFO next to the engine's socket.

Why: a consumer that polls rings on a timer pays for every empty pass (most of the ring's CPU cost in
``benchmarks/ring_ipc.py``) and adds up to a period of latency. With the doorbell the audio thread sleeps in
``poll`` until someone has written something for it: ring producers after writing caller audio, and the engine's
own scheduler thread after queueing reply audio (``Doorbell.ring``). A hand-off costs one wake-up per burst, not
one per poll. Producers coalesce: the media side rings at most once per event-loop iteration, however many
sessions it wrote to, so at 50 sessions one syscall serves 50 frames.

A full FIFO (the consumer is busy) means a wake-up is already pending; extra rings are dropped on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import stat
from pathlib import Path


class Doorbell:
    """Consumer side: owns the FIFO, waits on it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISFIFO(self.path.stat().st_mode):
                raise FileExistsError(f"{self.path} exists and is not a FIFO")
            self.path.unlink()  # a stale FIFO of a dead engine: start clean
        os.mkfifo(self.path, 0o600)
        self._rfd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        # Keep a writer open ourselves, so the FIFO never reports EOF (select would spin) when producers come and go.
        self._wfd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        # One poll object registered once: ~15% less CPU per wake-up than building select()'s fd sets each time.
        self._poll = select.poll()
        self._poll.register(self._rfd, select.POLLIN)
        self._closed = False

    def wait(self, timeout: float) -> bool:
        """Sleep until rung or ``timeout`` seconds pass; True if rung. Drains pending rings."""
        if timeout > 0 and not self._poll.poll(timeout * 1000.0):
            return False
        try:
            return bool(os.read(self._rfd, 4096))
        except BlockingIOError:
            return False

    def ring(self) -> None:
        """Wake the waiter from inside the consumer's own process (another of its threads). Never blocks."""
        if self._closed:
            return
        with contextlib.suppress(OSError):  # full (a wake-up is pending already) or closed at shutdown
            os.write(self._wfd, b"\x01")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._rfd)
        os.close(self._wfd)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class DoorbellButton:
    """Producer side: rings the engine's doorbell. Never blocks; a missing or full FIFO is not an error."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._pending = False
        #: Rings actually written (after coalescing).
        self.rings = 0
        with contextlib.suppress(OSError):
            self._fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)

    @property
    def connected(self) -> bool:
        return self._fd is not None

    def ring_soon(self) -> None:
        """Ring once when the running event loop finishes its current iteration, however many writes call
        this during it: the media side writes many sessions' rings per iteration and pays one syscall."""
        if self._fd is None or self._pending:
            return
        self._pending = True
        asyncio.get_running_loop().call_soon(self._ring_pending)

    def _ring_pending(self) -> None:
        self._pending = False
        self.ring()

    def ring(self) -> None:
        if self._fd is None:
            return
        self.rings += 1
        try:
            os.write(self._fd, b"\x01")
        except BlockingIOError:
            pass  # full: the consumer has wake-ups pending already
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.EBADF):
                self.close()  # the engine went away; its loss is reported on the control channel
            else:
                raise

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
