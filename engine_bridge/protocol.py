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
    #: What ends the caller's turn: ``"model"`` (the semantic end-of-turn model, waiting up to
    #: ``eot_max_wait_ms``) or ``"silence"`` (``silence_ms`` alone); engine settings ``turn_taking.end_of_turn``.
    end_of_turn: Literal["model", "silence"] | None = None
    eot_threshold: float | None = None
    eot_max_wait_ms: int | None = None
    barge_in_min_ms: int | None = None
    #: False: a caller turn is transcribed and kept in the conversation, but no reply starts until the client asks
    #: (``AppendText(kind="respond")``); the Realtime dialect's ``create_response: false`` and manual mode.
    auto_reply: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One function tool (the engine's ``thinker.tools.ToolSpec``): ``parameters`` is its arguments' JSON schema.
    The engine refuses a tool it cannot constrain a call to (``ErrorCode.INVALID_TOOLS``)."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class ToolChoiceSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Whether a reply may (``auto``), may not (``none``) or must (``required``) call a tool, or must call the
    function ``name`` (``function``); the engine's ``thinker.tools.ToolChoice``."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


class ToolCallItem(msgspec.Struct, kw_only=True):
    """A function call the model made: ``arguments`` is JSON text, always valid for the tool's schema (the reply
    was grammar-constrained). ``call_id`` names it for its result (``AppendText(kind="tool_result")``)."""

    call_id: str
    name: str
    arguments: str


class SessionConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    instructions: str = ""
    history: list[ChatTurn] = msgspec.field(default_factory=list)
    voice: str = ""
    #: ``None``: the engine's configured adapter. ``"loopback"`` is a test fixture that echoes caller audio.
    adapter: str | None = None
    turn_taking: TurnTakingConfig = msgspec.field(default_factory=TurnTakingConfig)
    #: Idle TTL: the session is reaped when no client touches it for this long (0: the engine default).
    idle_ttl_s: float = 0.0
    #: Sampling temperature of the session's replies (None: the engine's spoken-reply decoding, greedy).
    temperature: float | None = None
    #: Most thinker tokens one reply may generate (0: the engine's own reply limit). A reply cut by it ends with
    #: ``ReplyDone(capped=True)``.
    max_output_tokens: int = 0
    #: Function tools the model may call; a reply that calls one ends with ``ReplyDone(tool_calls=[...])``.
    tools: list[ToolDef] = msgspec.field(default_factory=list)
    tool_choice: ToolChoiceSpec = msgspec.field(default_factory=ToolChoiceSpec)
    #: After a reply that ended in a function call, the caller hears a short spoken acknowledgement once this
    #: many ms pass without the call's result (or other words for the caller); -1: none.
    acknowledgement_delay_ms: int = -1


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


AppendKind = Literal[
    "instructions",
    "thinking",
    "commentary",
    "speak_now",
    "user",
    "assistant",
    "respond",
    "tool_call",
    "tool_result",
]


class AppendText(_Msg):
    """Text into the conversation.

    * ``instructions``: standing developer instructions;
    * ``thinking``: silent context, no reply requested;
    * ``commentary`` / ``speak_now``: the model replies now, without waiting for caller speech;
    * ``user`` / ``assistant``: a typed message of that role (the Realtime dialect's ``conversation.item.create``),
      no reply requested;
    * ``respond``: the model replies now to the conversation as it stands, with no added prompt (the Realtime
      dialect's ``response.create``);
    * ``tool_call``: a function call the client puts into the conversation as the assistant's (``call``; ``text``
      unused), no reply requested;
    * ``tool_result``: the result of the call ``call_id`` (``text``: the output), no reply requested (``respond``
      asks for the answer built on it).
    """

    req_id: int
    session_id: str
    kind: AppendKind
    text: str = ""
    #: ``respond`` only: the most thinker tokens this one reply may generate (0: the session's limit).
    max_output_tokens: int = 0
    #: ``respond`` only: this reply's tool choice (None: the session's).
    tool_choice: ToolChoiceSpec | None = None
    #: ``tool_result``: the call the result answers.
    call_id: str = ""
    #: ``tool_call``: the call.
    call: ToolCallItem | None = None


class SetMute(_Msg):
    req_id: int
    session_id: str
    muted: bool


class Interrupt(_Msg):
    """Stop model speech now (a fixture takes the floor, the app cancels). Bumps the epoch."""

    req_id: int
    session_id: str


# Conversation edits (the Realtime dialect's conversation.item.truncate/delete and out-of-band responses).


class TruncateReply(_Msg):
    """Keep only ``text`` of finished reply ``turn_id`` in the conversation (the Realtime dialect's
    ``conversation.item.truncate``: the whole words the listener heard). The thinker's log is rolled back to the
    reply's checkpoint and re-extended with ``text`` and everything after it; applied once no reply runs.
    A reply already holding no more than ``text``, or unknown, is left alone."""

    req_id: int
    session_id: str
    turn_id: int
    text: str


class UpdateSession(_Msg):
    """Change a running session's settings (the Realtime dialect's ``session.update`` mid-session). Every field is
    optional: None keeps the current value. Applied by the session's owner (the scheduler thread) in mailbox order:
    turn-taking, voice, temperature and the token cap from the next turn or reply on; new ``instructions`` rebuild
    the thinker's system segment (one rebuild of the log, the conversation kept), deferred while a reply runs.
    ``turn_taking`` replaces the session's turn-taking overrides as a whole."""

    req_id: int
    session_id: str
    instructions: str | None = None
    voice: str | None = None
    turn_taking: TurnTakingConfig | None = None
    temperature: float | None = None
    max_output_tokens: int | None = None
    #: New tools replace the session's (the thinker lists them in its system segment, as a change of instructions
    #: does); ``[]`` removes them.
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceSpec | None = None
    #: -1 turns the automatic acknowledgement off.
    acknowledgement_delay_ms: int | None = None


class Touch(_Msg):
    """Keep an idle session alive (its TTL restarts)."""

    req_id: int
    session_id: str


class CloseReason(enum.StrEnum):
    """Why an engine session closed: the reason a client gives in :class:`CloseSession`, and the one
    :class:`SessionClosed` reports (the client's, or the engine's own)."""

    # Given by the client (CloseSession).
    CLIENT = "client"  # the client is done with it (the default)
    CLIENT_SHUTDOWN = "client_shutdown"  # the EngineClient closes every session it still holds
    EVENT_OVERFLOW = "event_overflow"  # the client's event consumer fell a whole event queue behind
    # The Live dialect's own session.closed reasons, passed on to the engine as they are.
    EXPIRED = "expired"
    CONTENT = "content"
    REMOTE_HANGUP = "remote_hangup"
    CONNECTION_LOST = "connection_lost"
    # Decided by the engine.
    CLIENT_GONE = "client_gone"  # the session's control connection vanished
    IDLE_TIMEOUT = "idle_timeout"  # nothing touched the session for its idle TTL
    ERROR = "error"  # the session's audio pump failed
    ENGINE_SHUTDOWN = "engine_shutdown"  # the engine is stopping
    SIDECAR_LOST = "sidecar_lost"  # the omni adapter's model server went away for good
    # Set by the client itself, never sent by the engine.
    ENGINE_LOST = "engine_lost"  # the engine's connection died
    OPEN_FAILED = "open_failed"  # the engine refused to open the session, or never answered


class CloseSession(_Msg):
    req_id: int
    session_id: str
    reason: CloseReason = CloseReason.CLIENT


class GetStats(_Msg):
    req_id: int
    session_id: str = ""


# --- text requests (chat completions on the thinker) ------------------------------------------------------------
#
# A text request is a short-lived thinker conversation, not a session: no rings, no audio, its own id namespace
# (``request_id``). StartText is answered once the engine has admitted it and prefilled its prompt (or refused
# it: ErrorReply with CAPACITY_EXCEEDED, CONTEXT_LENGTH_EXCEEDED, UNSUPPORTED, INVALID_REQUEST); its tokens then
# arrive as TextDelta events and it ends with exactly one TextDone. AbortText (or the client's connection closing)
# ends it at once and frees its KV.


class TextMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One chat message of a text request (rendered with the voice sessions' chat template). An assistant message
    may carry the calls it made (``tool_calls``); a ``tool`` message is the result of the call ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    text: str
    tool_calls: list[ToolCallItem] = msgspec.field(default_factory=list)
    tool_call_id: str = ""


class TextSampling(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How a text request is decoded. ``max_tokens`` None: up to the context limit."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    #: Generation stops before the first of these strings (which is not returned).
    stop: list[str] = msgspec.field(default_factory=list)


class StartText(_Msg):
    req_id: int
    request_id: str
    messages: list[TextMessage]
    sampling: TextSampling = msgspec.field(default_factory=TextSampling)
    tools: list[ToolDef] = msgspec.field(default_factory=list)
    tool_choice: ToolChoiceSpec = msgspec.field(default_factory=ToolChoiceSpec)


class AbortText(_Msg):
    """Stop a text request now (the HTTP client went away); its KV is freed before the reply."""

    req_id: int
    request_id: str


Command = (
    Hello
    | Ping
    | OpenSession
    | AppendText
    | SetMute
    | Interrupt
    | TruncateReply
    | UpdateSession
    | Touch
    | CloseSession
    | GetStats
    | StartText
    | AbortText
)


# --- replies (engine -> client) --------------------------------------------------------------------------------


# Each command has one result type (:data:`RESULT_OF`); a :class:`Reply` carries it, tagged, so the serving side
# decodes it by type instead of reading a dict.


class _Result(msgspec.Struct, tag_field="type", tag=str.lower, kw_only=True, omit_defaults=True):
    pass


class Ack(_Result):
    """A command that has nothing to report (Touch, CloseSession)."""


class EngineState(enum.StrEnum):
    """Where the engine stands. The engine process reports the first four (``EngineHealth.state``); the serving
    side's supervisor (``livekit_omni/supervisor.py``) adds the two it alone can know."""

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"  # loading the models failed (``EngineHealth.error`` says why)
    RESTARTING = "restarting"  # the supervisor lost the engine and starts a new one
    STOPPED = "stopped"  # the supervisor stopped it


class EngineHealth(_Result, kw_only=True):
    """The engine's state and load (Hello, Ping, and GetStats without a session): what /health shows."""

    engine_pid: int
    state: EngineState
    error: str | None = None
    protocol: int = PROTOCOL_VERSION
    max_sessions: int
    active_sessions: int
    opened_sessions: int = 0
    rejected_sessions: int = 0
    uptime_s: float = 0.0
    rss_bytes: int = 0
    #: Path of the engine's doorbell FIFO ("" without one).
    doorbell: str = ""
    #: Whether the ingress ring's per-frame path is the C core (else pure Python).
    ring_native: bool = False
    audio_tick_overruns: int = 0
    adapter: str = ""
    #: What the adapter adds about its models (names, KV-cache bytes, ...), adapter-specific.
    details: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> EngineHealth:
        """Build from a flat mapping (the engine's health dict): the named fields, everything else in ``details``."""
        known = {k: v for k, v in fields.items() if k in cls.__struct_fields__ and k != "details"}
        details = {k: v for k, v in fields.items() if k not in cls.__struct_fields__}
        return msgspec.convert({**known, "details": details}, cls)

    def flat(self) -> dict[str, Any]:
        """The flat mapping /health reports: the named fields with ``details`` merged in."""
        out = msgspec.structs.asdict(self)
        details = out.pop("details")
        return {**out, **details}


class SessionOpened(_Result):
    session_id: str
    epoch: int
    #: The session is reaped after this long without activity (caller audio read, or a command).
    idle_ttl_s: float


class TextAppended(_Result):
    """Where the text landed on the session's input timeline (ms)."""

    start_ms: int
    end_ms: int


class MuteSet(_Result):
    muted: bool


class Interrupted(_Result):
    """The epoch after the bump: audio of older epochs is stale."""

    epoch: int


class PlayoutPosition(msgspec.Struct, kw_only=True):
    epoch: int
    turn_id: int
    samples: int


class LogEntry(msgspec.Struct, kw_only=True):
    """One message of the engine's conversation log."""

    role: str
    text: str
    epoch: int
    turn_id: int = 0
    audio_start_ms: int = 0
    audio_end_ms: int = 0
    token_start: int = 0
    token_end: int = 0
    interrupted: bool = False


class SessionStats(_Result, kw_only=True):
    """One session as the engine sees it (GetStats with a session): counters, playout and conversation log."""

    session_id: str
    state: SessionState
    epoch: int
    turn_id: int
    input_seconds: float
    output_seconds: float
    turns: int
    barge_ins: int
    ignored_short_speech: int = 0
    ingress_overruns: int = 0
    egress_overruns: int = 0
    stale_dropped: int = 0
    playout: PlayoutPosition
    log: list[LogEntry] = msgspec.field(default_factory=list)
    #: The adapter's own counters (turn latencies, speculation, ...), adapter-specific.
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> SessionStats:
        """Build from the engine session's flat snapshot: the named fields, everything else in ``extra``."""
        known = {k: v for k, v in fields.items() if k in cls.__struct_fields__ and k != "extra"}
        extra = {k: v for k, v in fields.items() if k not in cls.__struct_fields__}
        return msgspec.convert({**known, "extra": extra}, cls)


# --- text requests: results and events (see the text request commands above) ------------------------------------


class TextStarted(_Result, kw_only=True):
    request_id: str
    #: Tokens the model read before its first output token (chat template and generation prompt included).
    prompt_tokens: int
    #: Of those, tokens whose KV was reused from a cache instead of computed.
    cached_tokens: int = 0
    #: The completion limit in force (the request's, or what the context leaves).
    max_tokens: int
    #: The thinker's model, as /v1/models names it.
    model: str = ""


class TextDelta(_Msg):
    request_id: str
    text: str
    #: Tokens generated so far (this delta's included).
    completion_tokens: int


TextFinish = Literal["stop", "length", "abort", "error", "tool_calls"]


class TextDone(_Msg):
    request_id: str
    finish_reason: TextFinish
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    error: str = ""
    #: The calls the completion made (finish reason ``tool_calls``).
    tool_calls: list[ToolCallItem] = msgspec.field(default_factory=list)


ReplyResult = (
    Ack | EngineHealth | SessionOpened | TextAppended | MuteSet | Interrupted | SessionStats | TextStarted
)

#: The result type each command's :class:`Reply` carries. GetStats answers EngineHealth without a session.
RESULT_OF: Final[dict[type[Command], type[ReplyResult]]] = {
    Hello: EngineHealth,
    Ping: EngineHealth,
    OpenSession: SessionOpened,
    AppendText: TextAppended,
    SetMute: MuteSet,
    Interrupt: Interrupted,
    TruncateReply: Ack,
    UpdateSession: Ack,
    Touch: Ack,
    CloseSession: Ack,
    GetStats: SessionStats,
    StartText: TextStarted,
    AbortText: Ack,
}


class Reply(_Msg):
    req_id: int
    result: ReplyResult = msgspec.field(default_factory=Ack)


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
    #: Text requests (StartText): the text budget or the thinker's KV budget is full; the prompt is too long;
    #: the adapter has no text completions.
    CAPACITY_EXCEEDED = "capacity_exceeded"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNSUPPORTED = "unsupported"
    #: A tool or tool choice the thinker cannot use (a bad name, a schema the grammar library cannot compile, a
    #: choice naming no tool, tools on an adapter without them); the session or request is unchanged.
    INVALID_TOOLS = "invalid_tools"


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
    #: Tokens: the context the reply was generated from, the part of it reused from the KV cache (not computed
    #: again for this reply), and the reply's own generated tokens.
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    #: Generation stopped at the reply's ``max_output_tokens`` (the client's cap), not at the model's end of turn.
    capped: bool = False
    #: The reply ended in these function calls (its ``text`` is what was said before them). They stay in the
    #: conversation; each waits for its ``AppendText(kind="tool_result")``.
    tool_calls: list[ToolCallItem] = msgspec.field(default_factory=list)


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
    reason: CloseReason


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

TextEvent = TextDelta | TextDone

EngineMessage = Reply | ErrorReply | SessionEvent | TextEvent
