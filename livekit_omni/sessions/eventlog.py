"""Optional JSONL logs of every server event the dialects emit (``LIVEKIT_OMNI_EVENT_LOG=/path/events.jsonl``).

Each dialect writes its own file beside the named one, the dialect before the suffix (``/path/events.live.jsonl``,
``/path/events.realtime.jsonl``): the two dialects validate against different models. Each line is one frame exactly
as it was sent to the client, audio deltas included (every session sends every frame through one method,
:meth:`livekit_omni.sessions.base.DialectSession.send_frame`, that logs it first), so the conformance test
(tests/test_zz_event_conformance.py) validates what crossed the wire against the openai SDK's models. Writing happens on a daemon thread behind a
bounded queue, so the event loop never waits on the disk; when the queue is full, lines are dropped and counted
rather than buffered without bound.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

ENV_VAR: Final = "LIVEKIT_OMNI_EVENT_LOG"
QUEUE_LIMIT: Final = 20_000


class EventLog:
    def __init__(self, path: str) -> None:
        self.path = path
        self.dropped = 0
        self._q: queue.Queue[bytes | None] = queue.Queue(QUEUE_LIMIT)
        self._thread = threading.Thread(target=self._run, name="event-log", daemon=True)
        self._thread.start()
        # Daemon threads die at interpreter exit; flush what is queued first (the last events of a test server
        # are its session.closed events).
        atexit.register(self.close)

    def write(self, line: bytes) -> None:
        try:
            self._q.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    def _run(self) -> None:
        # O_APPEND with one write() per batch: several server processes may share the file (one test session
        # runs many servers), and appends of whole lines do not interleave on a local filesystem.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            while True:
                item = self._q.get()
                batch: list[bytes] = []
                stop = item is None
                if item is not None:
                    batch.append(item)
                while not stop and len(batch) < 512:
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stop = True
                    else:
                        batch.append(nxt)
                if batch:
                    os.write(fd, b"\n".join(batch) + b"\n")
                if stop:
                    return
        except OSError as e:
            log.error("event log %s: %s; no further events are logged", self.path, e)
        finally:
            os.close(fd)


def dialect_log_path(path: str | os.PathLike[str], dialect: str) -> Path:
    """Where ``dialect``'s frames go when ``LIVEKIT_OMNI_EVENT_LOG`` is ``path``."""
    named = Path(path)
    return named.with_name(f"{named.stem}.{dialect}{named.suffix or '.jsonl'}")


_logs: dict[str, EventLog | None] = {}


def event_log(dialect: str) -> EventLog | None:
    """The process's event log of ``dialect`` (``live``, ``realtime``), or None when LIVEKIT_OMNI_EVENT_LOG is not
    set."""
    if dialect not in _logs:
        path = os.environ.get(ENV_VAR)
        _logs[dialect] = EventLog(str(dialect_log_path(path, dialect))) if path else None
    return _logs[dialect]
