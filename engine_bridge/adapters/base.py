"""The model-adapter ABC: one per model family (cascade now, native duplex later).

Threading contract (see :mod:`engine_bridge.session`): ``on_audio`` runs on the audio thread and must be cheap
(turn-taking and barge-in live there); every other method runs on the scheduler thread, the session's owner.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_bridge import protocol as p
from engine_bridge.config import EngineSettings
from engine_bridge.session import DuplexSession
from engine_bridge.text import TextRefused, TextRequest


@dataclass(frozen=True, slots=True)
class AdapterCaps:
    #: The model decides turns itself (a native duplex model); else the engine's turn-taking stage does.
    owns_turn_taking: bool
    #: The conversation state survives barge-in (KV lease with rollback).
    resident_kv: bool
    exact_rollback: bool
    #: Text requests (/v1/chat/completions) run on the adapter's LLM: ``submit_text`` accepts them and ``step``
    #: advances them after the voice sessions' work.
    text_completions: bool = False
    #: A client interrupt (and caller speech over the model, where the engine detects it) cuts the model off.
    #: A model that owns turn-taking may still take barge-in as a safety net; one that refuses it only has its
    #: output fenced on our side.
    barge_in: bool = True
    #: Replies may call function tools (``SessionConfig.tools``), with arguments constrained to their schemas.
    tools: bool = False


class SessionRefused(Exception):
    """``open`` refused the session for a reason the client should see by its code (e.g. the model server is at
    capacity: ``session_limit_reached``), instead of a generic open failure."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ModelAdapter(ABC):
    name: str = ""
    caps: AdapterCaps
    #: How long the scheduler thread sleeps when :meth:`step` did no work before it looks again (it wakes at once
    #: when ``wake`` is set). 5 ms suits adapters whose ``step`` has work to find on its own (a decode to run);
    #: an adapter whose ``step`` never works raises it, so an idle scheduler does not wake 200 times a second.
    scheduler_idle_s: float = 0.005

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        #: Set by the engine: posting to a mailbox from another thread should also set it, so the scheduler
        #: does not sleep through the message.
        self.wake: threading.Event | None = None
        #: Set by the engine: ends a session from any thread, as an engine-side failure would (the adapter's
        #: model server died under it). Emit the typed ``SessionError`` first, then call it with the reason.
        self.end_session: Callable[[DuplexSession, p.CloseReason], None] | None = None

    def load(self) -> None:
        """Load models (engine start-up, before sessions are admitted). Default: nothing to load."""
        return None

    def describe(self) -> dict[str, Any]:
        """What /health shows about the loaded models."""
        return {"adapter": self.name}

    def capabilities(self) -> dict[str, bool]:
        """The capabilities as data: what /health and ``session.started`` report."""
        return dataclasses.asdict(self.caps)

    def check_tools(self, tools: Sequence[p.ToolDef], choice: p.ToolChoiceSpec) -> str | None:
        """Why replies could not be constrained to these tools and this choice (None: they can). Called off the
        scheduler thread before a session opens or updates with tools, so :meth:`open` and ``handle`` get only
        tools they accept. Default: no function tools on this adapter."""
        if tools or choice.mode in ("required", "function"):
            return f"the {self.name!r} adapter does not run function tools"
        return None

    @abstractmethod
    def open(self, session: DuplexSession) -> None:
        """Set up per-session model state (e.g. prefill the instructions into a fresh KV lease)."""

    @abstractmethod
    def close(self, session: DuplexSession) -> None:
        """Release per-session model state. Must be idempotent."""

    @abstractmethod
    def on_audio(self, session: DuplexSession, pcm: np.ndarray) -> None:
        """Caller audio just read from ingress (int16 at the engine input rate). Audio thread: keep it cheap."""

    @abstractmethod
    def handle(self, session: DuplexSession, msg: Any) -> None:
        """A mailbox message (text appends, interrupts, mute, events posted by ``on_audio``)."""

    @abstractmethod
    def step(self, sessions: list[DuplexSession]) -> bool:
        """One round of model work for every session that has some (batched where the model allows).
        Returns True if any work was done, so the scheduler knows whether to idle."""

    # --- text requests (only adapters with ``caps.text_completions``) ---------------------------------------
    def submit_text(self, request: TextRequest) -> None:
        """Queue a text request (any thread). The scheduler thread admits it in a later :meth:`step` and
        resolves ``request.admitted``. Default: refused, this adapter has no LLM to run text on."""
        raise TextRefused(p.ErrorCode.UNSUPPORTED, f"the {self.name!r} adapter does not run text completions")

    def has_text_work(self) -> bool:
        """True while text requests are queued or running (the scheduler steps the adapter even with no
        session open)."""
        return False
