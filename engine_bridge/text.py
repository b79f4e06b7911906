"""Text requests on the engine: what the serving side's /v1/chat/completions becomes in the engine process.

A :class:`TextRequest` is created on the engine's event loop (StartText), handed to the adapter, and from then on
owned by the scheduler thread, which admits it (thinker open + prefill), steps it and ends it. The two threads
meet in three places only, each thread-safe on its own:

* ``admitted`` — a ``concurrent.futures.Future`` the event loop awaits to answer StartText (a
  :class:`TextStarted` result, or a :class:`TextRefused` exception carrying the protocol error code);
* ``emit`` — sends TextDelta/TextDone over the request's connection (``loop.call_soon_threadsafe`` inside);
* ``abort_requested`` — set by AbortText or a disconnect; the scheduler ends the request at its next pass
  and resolves ``closed``.

Its status moves QUEUED → RUNNING → FINISHED (or QUEUED → FINISHED when refused or aborted before admission).
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_bridge import protocol as p


class TextStatus(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


class TextRefused(Exception):
    """The adapter would not start a text request; ``code`` is a :class:`protocol.ErrorCode`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False, slots=True)
class TextRequest:
    request_id: str
    #: The engine connection that started it (its requests are aborted when it goes away).
    owner_id: int
    messages: list[p.TextMessage]
    sampling: p.TextSampling
    emit: Callable[[p.TextEvent], None]
    #: Function tools the reply may call, and whether it may (``StartText.tools``, ``tool_choice``).
    tools: list[p.ToolDef] = field(default_factory=list)
    tool_choice: p.ToolChoiceSpec = field(default_factory=p.ToolChoiceSpec)
    admitted: concurrent.futures.Future[p.TextStarted] = field(default_factory=concurrent.futures.Future)
    #: Resolved once the request is finished and its thinker state released.
    closed: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    abort_requested: threading.Event = field(default_factory=threading.Event)
    status: TextStatus = TextStatus.QUEUED

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("a text request needs an id")
        if not self.messages:
            raise ValueError("a text request needs at least one message")

    def refuse(self, code: str, message: str) -> None:
        """Scheduler thread: end a request that never ran (StartText gets the error)."""
        self.status = TextStatus.FINISHED
        if not self.admitted.done():
            self.admitted.set_exception(TextRefused(code, message))
        if not self.closed.done():
            self.closed.set_result(None)

    def finish(self, done: p.TextDone) -> None:
        """Scheduler thread: end a running request (its TextDone is the last event it sends)."""
        self.status = TextStatus.FINISHED
        self.emit(done)
        if not self.closed.done():
            self.closed.set_result(None)
