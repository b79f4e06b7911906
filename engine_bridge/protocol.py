"""Typed messages of the control channel between the serving side and the engine process.

The one schema module: every command, reply and event is a ``msgspec.Struct`` here, and the wire format
(msgpack, length-prefixed frames) is derived from these types in :mod:`engine_bridge.control`. Audio never travels
on this channel; it lives in the shared-memory rings of :mod:`engine_bridge.ring`.

Conventions:
* Every command carries ``req_id`` (unique per connection, > 0). The engine answers each command with exactly one
  :class:`Reply` or :class:`ErrorReply` carrying the same ``req_id``.
* Every session event carries ``session_id``. Timeline positions are integer milliseconds since the session
  started: input positions count caller audio read from the ingress ring; output positions count samples of the
  reply turn (``turn_id``) so the media side can place them on its own output clock.
"""

from __future__ import annotations

import enum
from typing import Any, Final, Literal

import msgspec

PROTOCOL_VERSION: Final = 1


class _Msg(msgspec.Struct, tag_field="type", tag=str.lower, kw_only=True, omit_defaults=True):
    pass


# --- session configuration -------------------------------------------------------------------------------------


class ChatTurn(msgspec.Struct, kw_only=True):
    """One message of startup history."""

    role: Literal["developer", "user", "assistant"]
    text: str


class TurnTakingConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-session overrides of the engine's turn-taking defaults; None keeps the engine's setting."""

    vad: Literal["webrtc", "silero"] | None = None
    aggressiveness: int | None = None
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_ms: int | None = None
    barge_in_min_ms: int | None = None


class SessionConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    instructions: str = ""
    history: list[ChatTurn] = msgspec.field(default_factory=list)
    voice: str = ""
    #: ``None``: the engine's configured adapter. ``"loopback"`` is a test fixture that echoes caller audio.
    adapter: str | None = None
    turn_taking: TurnTakingConfig = msgspec.field(default_factory=TurnTakingConfig)
    #: Idle TTL: the session is reaped when no client touches it for this long (0: the engine default).
    idle_ttl_s: float = 0.0


# --- commands (client -> engine) -------------------------------------------------------------------------------


class Hello(_Msg):
    req_id: int
    client: str = ""
    pid: int = 0
    protocol: int = PROTOCOL_VERSION


class Ping(_Msg):
    req_id: int


class OpenSession(_Msg):
    req_id: int
    session_id: str
    ingress: str
    egress: str
    config: SessionConfig = msgspec.field(default_factory=SessionConfig)


class AppendText(_Msg):
    """Text into the conversation.

    * ``instructions``: standing developer instructions;
    * ``thinking``: silent context, no reply requested;
    * ``commentary`` / ``speak_now``: the model replies now, without waiting for caller speech.
    """

    req_id: int
    session_id: str
    kind: Literal["instructions", "thinking", "commentary", "speak_now"]
    text: str = ""


class SetMute(_Msg):
    req_id: int
    session_id: str
    muted: bool


class Interrupt(_Msg):
    """Stop model speech now (a fixture takes the floor, the app cancels). Bumps the epoch."""

    req_id: int
    session_id: str


class Touch(_Msg):
    """Keep an idle session alive (its TTL restarts)."""

    req_id: int
    session_id: str


class CloseSession(_Msg):
    req_id: int
    session_id: str
    reason: str = "client"


class GetStats(_Msg):
    req_id: int
    session_id: str = ""


Command = Hello | Ping | OpenSession | AppendText | SetMute | Interrupt | Touch | CloseSession | GetStats


# --- replies (engine -> client) --------------------------------------------------------------------------------


class Reply(_Msg):
    req_id: int
    result: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorCode(enum.StrEnum):
    BAD_MESSAGE = "bad_message"
    UNKNOWN_SESSION = "unknown_session"
    SESSION_EXISTS = "session_exists"
    SESSION_LIMIT_REACHED = "session_limit_reached"
    ENGINE_LOADING = "engine_loading"
    RING_ERROR = "ring_error"
    INVALID_REQUEST = "invalid_request"
    TIMEOUT = "timeout"
    ENGINE_LOST = "engine_lost"
    INTERNAL = "internal_error"


class ErrorReply(_Msg):
    req_id: int
    code: str
    message: str


# --- session events (engine -> client) -------------------------------------------------------------------------


class SessionState(enum.StrEnum):
    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    THINKING = "thinking"
    SPEAKING = "speaking"
    CLOSING = "closing"
    CLOSED = "closed"


class StateChanged(_Msg):
    session_id: str
    state: SessionState
    at_ms: int


class SpeechStarted(_Msg):
    session_id: str
    at_ms: int


class SpeechStopped(_Msg):
    session_id: str
    at_ms: int


class InputTranscript(_Msg):
    """Caller text. ``final`` closes the caller's turn ``item_id``; partials may precede it."""

    session_id: str
    item_id: str
    text: str
    start_ms: int
    end_ms: int
    final: bool


class ReplyStarted(_Msg):
    session_id: str
    turn_id: int
    epoch: int


class OutputTranscript(_Msg):
    """Model text for samples ``[start_sample, end_sample)`` of reply ``turn_id`` (at the egress rate).

    The media side emits it when its playout of that turn reaches ``start_sample``, so text is only ever shown
    for audio that actually left the server; a bumped epoch drops it with the audio.
    """

    session_id: str
    turn_id: int
    epoch: int
    text: str
    start_sample: int
    end_sample: int


class ReplyDone(_Msg):
    session_id: str
    turn_id: int
    epoch: int
    interrupted: bool
    #: The reply text as kept in the conversation (only the played part after a barge-in).
    text: str
    total_samples: int


class BargeIn(_Msg):
    session_id: str
    epoch: int
    turn_id: int
    at_ms: int
    played_samples: int


class Usage(_Msg):
    session_id: str
    input_seconds: float
    output_seconds: float
    context_tokens: int
    context_limit: int


class SessionError(_Msg):
    session_id: str
    code: str
    message: str
    fatal: bool


class SessionClosed(_Msg):
    session_id: str
    reason: str


SessionEvent = (
    StateChanged
    | SpeechStarted
    | SpeechStopped
    | InputTranscript
    | ReplyStarted
    | OutputTranscript
    | ReplyDone
    | BargeIn
    | Usage
    | SessionError
    | SessionClosed
)

EngineMessage = Reply | ErrorReply | SessionEvent
