"""The OpenAI Live protocol as this server speaks it: every client command and every server event, as types.

The one protocol module. The facade decodes commands and encodes events with it (:mod:`livekit_omni.live.session`);
the plugin's remote mode encodes commands and decodes events with the same types (:mod:`livekit_omni.plugin.remote`),
and so does the test client (:mod:`testkit.live_client`). docs/protocol.md describes it for users.

* Client commands are ``msgspec`` structs tagged by ``type``; unknown fields are ignored (a compatible server
  should ignore them). :func:`decode_command` turns one text frame into a command or a :class:`WireError` that
  names the problem, so the session answers with an ``error`` event and goes on.
* Server events are tagged structs too (:data:`ServerEvent`), each with a fresh ``event_id`` (and
  ``client_event_id`` when the command that caused it had one); :func:`encode` writes them and
  :func:`decode_server_event` reads them back. Optional fields that are unset are left out of the JSON, as the
  stock clients expect. Output audio (:class:`OutputAudioDelta`) holds raw bytes; msgspec writes them as base64
  in C, so the hot path costs no Python-level base64 call.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

# The refusal and its types are one for both dialects (livekit_omni.sessions.errors); this module's users name them
# through it.
from livekit_omni.sessions.audio import Encoding as Encoding
from livekit_omni.sessions.audio import WireFormat as WireFormat
from livekit_omni.sessions.audio import decode_audio as decode_audio
from livekit_omni.sessions.codec import WireCodec
from livekit_omni.sessions.errors import INVALID_REQUEST as INVALID_REQUEST
from livekit_omni.sessions.errors import SERVER_ERROR as SERVER_ERROR
from livekit_omni.sessions.errors import WireError as WireError

# --- configuration (session.start, and the resolved SessionResource) ------------------------------------------
# One set of structs for both directions: the facade decodes them from session.start, the remote plugin encodes
# them into its session.start, and the resolved configuration reuses them in session.started. Unset optional
# fields are left out of the JSON (omit_defaults).


class _Part(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class TextPart(_Part):
    text: str
    type: str | None = None


class InitialItem(_Part):
    role: str
    content: list[TextPart]
    type: str | None = None
    id: str | None = None
    status: str | None = None


class AudioFormat(_Part):
    type: str
    rate: int | None = None


class CustomVoice(_Part):
    id: str


class AudioOutput(_Part):
    #: A built-in name, any string, or a custom voice ``{"id": "voice_..."}``.
    voice: str | CustomVoice | None = None


class AudioConfig(_Part):
    format: AudioFormat | None = None
    output: AudioOutput | None = None


class Delegation(_Part):
    type: str
    #: The Responses backend's settings under ``responses`` delegation (model, instructions, tools, tool_choice,
    #: ...). The engine's own thinker is the backend: its function tools and tool choice are the engine session's,
    #: its instructions follow the voice instructions; the rest is echoed (docs/protocol.md, Delegation).
    responses: dict[str, Any] | None = None
    acknowledgement_delay_ms: int | None = None
    #: An extension, ``client`` delegation only: whether a reply may (``auto``, the default), must (``required``)
    #: or may not (``none``) hand the caller's task to the application.
    tool_choice: str | None = None


class ServerEventSelector(_Part):
    type: str
    response_event: str | None = None


class DataChannelPermissions(_Part):
    """Which events an (untrusted) WebRTC front end may send and receive: ``"all"`` or a list."""

    allowed_client_events: Literal["all"] | list[str] | None = None
    allowed_server_events: Literal["all"] | list[ServerEventSelector] | None = None


class ClientConfig(_Part):
    data_channel: DataChannelPermissions


class StartConfig(_Part):
    model: str
    instructions: str | None = None
    input: list[InitialItem] | None = None
    audio: AudioConfig | None = None
    delegation: Delegation | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    triggers: list[dict[str, Any]] | None = None
    client: ClientConfig | None = None


class UpdateConfig(_Part):
    delegation: Delegation | msgspec.UnsetType | None = msgspec.UNSET
    triggers: list[dict[str, Any]] | msgspec.UnsetType | None = msgspec.UNSET
    # Present only to be refused: they are fixed once the session has started.
    model: Any = msgspec.UNSET
    instructions: Any = msgspec.UNSET
    input: Any = msgspec.UNSET
    audio: Any = msgspec.UNSET
    client: Any = msgspec.UNSET
    store: Any = msgspec.UNSET
    safety_identifier: Any = msgspec.UNSET


# --- client commands ------------------------------------------------------------------------------------------


class _Cmd(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    event_id: str | None = None


class SessionStart(_Cmd, tag="session.start"):
    session: StartConfig


class SessionUpdate(_Cmd, tag="session.update"):
    session: UpdateConfig


class InputAudioAppend(_Cmd, tag="session.input_audio.append"):
    audio: str


class InputAudioMute(_Cmd, tag="session.input_audio.mute"):
    pass


class InputAudioUnmute(_Cmd, tag="session.input_audio.unmute"):
    pass


class InstructionsAppend(_Cmd, tag="session.instructions.append"):
    content: str
    delegation_id: str | None  # the key is required, null is allowed


class ThinkingAppend(_Cmd, tag="session.thinking.append"):
    content: str
    delegation_id: str | None


class CommentaryAppend(_Cmd, tag="session.commentary.append"):
    content: str
    delegation_id: str | None


class FixturePlay(_Cmd, tag="session.output_audio.fixture.play"):
    audio: str


class SessionClose(_Cmd, tag="session.close"):
    pass


class ResponseItemCreate(_Cmd, tag="response.item.create"):
    """An input item for the Responses backend (``responses`` delegation): a ``function_call_output`` answering a
    call, or a message. Checked by the session (livekit_omni.live.delegation)."""

    item: dict[str, Any]


class ResponseCreate(_Cmd, tag="response.create"):
    """Continue the delegation whose calls now have their outputs (or start a response of the backend): the model
    speaks the continuation."""


class SessionResume(_Cmd, tag="session.resume"):
    """An extension: instead of ``session.start``, re-attach to a session whose connection dropped, with the
    ``resume_token`` of its last ``session.started`` (single use; docs/protocol.md, "Resume")."""

    resume_token: str


ClientCommand = (
    SessionStart
    | SessionUpdate
    | InputAudioAppend
    | InputAudioMute
    | InputAudioUnmute
    | InstructionsAppend
    | ThinkingAppend
    | CommentaryAppend
    | FixturePlay
    | ResponseItemCreate
    | ResponseCreate
    | SessionClose
    | SessionResume
)
TextAppend = InstructionsAppend | ThinkingAppend | CommentaryAppend

#: Commands of the Live protocol this server knows but does not serve, with the reason given to the client.
UNSUPPORTED_COMMANDS: Final[dict[str, str]] = {
    "decision.create": "the Decisions API is not available on this server",
    "decision.item.create": "the Decisions API is not available on this server",
    "decision.item.delete": "the Decisions API is not available on this server",
    "transport.dtmf.send": "DTMF is only available on SIP sessions, which this server does not host",
}


class _Envelope(msgspec.Struct):
    type: Any = None
    event_id: Any = None


_command_decoder: Final = msgspec.json.Decoder(ClientCommand)
_envelope_decoder: Final = msgspec.json.Decoder(_Envelope)
_KNOWN_TYPES: Final = frozenset(
    t.__struct_config__.tag
    for t in (
        SessionStart,
        SessionUpdate,
        InputAudioAppend,
        InputAudioMute,
        InputAudioUnmute,
        InstructionsAppend,
        ThinkingAppend,
        CommentaryAppend,
        FixturePlay,
        ResponseItemCreate,
        ResponseCreate,
        SessionClose,
        SessionResume,
    )
)


def decode_command(raw: str | bytes) -> ClientCommand:
    """One text frame -> a command. Raises :class:`WireError` naming what is wrong (the session survives)."""
    try:
        return _command_decoder.decode(raw)
    except msgspec.ValidationError as e:
        failure: msgspec.ValidationError | msgspec.DecodeError = e
    except msgspec.DecodeError as e:
        failure = e
    except RecursionError:
        # msgspec refuses nesting deeper than Python's recursion limit by raising this; it is bad input too.
        raise WireError("invalid_json", "the message nests JSON too deeply") from None
    except UnicodeDecodeError:
        # msgspec raises this (not DecodeError) for a binary frame that is not UTF-8.
        raise WireError("invalid_json", "the message is not valid UTF-8") from None
    # Slow path, errors only: find out what kind of wrong it is.
    try:
        env = _envelope_decoder.decode(raw)
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise WireError("invalid_json", "the message must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        raise WireError("invalid_json", "the message is not valid JSON") from None
    cid = env.event_id if isinstance(env.event_id, str) else None
    if not isinstance(env.type, str):
        raise WireError("invalid_event", "the event has no string `type`", param="type", client_event_id=cid)
    if env.type in UNSUPPORTED_COMMANDS:
        raise WireError(
            "unsupported_event",
            f"{env.type} is not supported: {UNSUPPORTED_COMMANDS[env.type]}",
            param="type",
            client_event_id=cid,
        )
    if env.type not in _KNOWN_TYPES:
        raise WireError(
            "unknown_event", f"unknown event type {env.type[:100]!r}", param="type", client_event_id=cid
        )
    text = str(failure)
    param = _param_from(text)
    raise WireError(
        "missing_required_parameter" if text.startswith("Object missing required field") else "invalid_value",
        f"invalid {env.type}: {failure}",
        param=param,
        client_event_id=cid,
    )


def _param_from(msg: str) -> str | None:
    # msgspec reports "... - at `$.session.audio.format.rate`" (or "Object missing required field `x` - at `$.y`").
    param = None
    if "- at `$." in msg:
        param = msg.rsplit("- at `$.", 1)[1].rstrip("`")
    if msg.startswith("Object missing required field `"):
        field = msg.split("`", 2)[1]
        param = f"{param}.{field}" if param else field
    return param


# --- audio formats: the session core's (livekit_omni.sessions.audio), with the Live wire name of each -----------

_FORMAT_TYPES: Final = {"pcm16": "audio/pcm", "pcmu": "audio/pcmu", "pcma": "audio/pcma"}


def format_wire(fmt: WireFormat) -> AudioFormat:
    """A session audio format as the Live protocol writes it."""
    return AudioFormat(type=_FORMAT_TYPES[fmt.encoding], rate=fmt.rate)


DEFAULT_FORMAT: Final = WireFormat("pcm16", 24_000)
#: Fixtures are PCM16 24 kHz whatever the session format (docs/protocol.md).
FIXTURE_FORMAT: Final = WireFormat("pcm16", 24_000)


def parse_format(fmt: AudioFormat | None) -> WireFormat:
    if fmt is None:
        # Not documented; 24 kHz PCM is what LiveKit sends and what fixtures use (docs/protocol.md).
        return DEFAULT_FORMAT
    p = "session.audio.format"
    if fmt.type == "audio/pcm":
        if fmt.rate not in (16_000, 24_000):
            raise WireError(
                "invalid_audio_format", "audio/pcm supports rate 16000 or 24000", param=f"{p}.rate"
            )
        return WireFormat("pcm16", fmt.rate)
    if fmt.type in ("audio/pcmu", "audio/pcma"):
        if fmt.rate not in (None, 8000):
            raise WireError("invalid_audio_format", f"{fmt.type} (G.711) uses rate 8000", param=f"{p}.rate")
        return WireFormat("pcmu" if fmt.type == "audio/pcmu" else "pcma", 8000)
    raise WireError(
        "invalid_audio_format",
        f"unsupported audio format {fmt.type!r}; use audio/pcm (16000 or 24000), audio/pcmu or audio/pcma",
        param=f"{p}.type",
    )


# --- session configuration ------------------------------------------------------------------------------------

MAX_INPUT_ITEMS: Final = 128
DEFAULT_VOICE: Final = "marin"
#: Context appends are at most 500 tokens; ~8 characters a token is a generous cap that still bounds memory.
MAX_APPEND_CHARS: Final = 4000
MAX_INSTRUCTIONS_CHARS: Final = 65_536
#: Startup history: the protocol caps it at 8,192 rendered tokens; ~4 characters a token.
MAX_INPUT_CHARS: Final = 32_768


@dataclass(slots=True)
class ResolvedConfig:
    """The session configuration with server defaults filled in: what ``session.started`` reports."""

    model: str
    instructions: str
    input: list[InitialItem]
    history: list[tuple[str, str]]  # (role, text) for the engine
    format: WireFormat | None  # None on WebRTC (negotiated)
    voice: str | CustomVoice
    delegation: Delegation
    store: bool
    store_requested: bool
    safety_identifier: str | None
    client: ClientConfig | None
    #: The session asked for ``client`` delegation explicitly (``session.delegation.type``): its model may hand tasks
    #: to the application. A session without a delegation (omitted or null) is a plain conversation.
    delegates_to_client: bool = False

    @property
    def voice_name(self) -> str:
        v = self.voice
        return v if isinstance(v, str) else v.id


def resolve_config(cfg: StartConfig, *, with_format: bool = True) -> ResolvedConfig:
    """Validate a ``session.start`` configuration. Raises WireError for anything this server cannot honour."""
    if not cfg.model.strip():
        raise WireError("invalid_value", "session.model must be a non-empty string", param="session.model")
    instructions = cfg.instructions or ""
    if len(instructions) > MAX_INSTRUCTIONS_CHARS:
        raise WireError(
            "instructions_too_long",
            f"instructions are limited to {MAX_INSTRUCTIONS_CHARS} characters",
            param="session.instructions",
        )
    delegation = resolve_delegation(cfg.delegation, current=None)
    if cfg.triggers:
        raise _unsupported_triggers()
    items, history = _resolve_input(cfg.input or [])
    audio = cfg.audio or AudioConfig()
    fmt = parse_format(audio.format) if with_format else None
    voice: str | CustomVoice = DEFAULT_VOICE
    if audio.output is not None and audio.output.voice is not None:
        voice = audio.output.voice
    return ResolvedConfig(
        model=cfg.model,
        instructions=instructions,
        input=items,
        history=history,
        format=fmt,
        voice=voice,
        delegation=delegation,
        # Sessions are never stored here (no fork, no recording download): the resolved value says so, and the
        # session tells the client with an ``info`` event when it asked for storage.
        store=False,
        store_requested=bool(cfg.store),
        safety_identifier=cfg.safety_identifier,
        client=_resolve_client(cfg.client),
        delegates_to_client=cfg.delegation is not None and delegation.type == "client",
    )


#: Delegation types a session may use. ``responses`` is LiveKit ``GPTLiveModel``'s default; the engine's own thinker
#: is its backend (livekit_omni.live.delegation).
DELEGATION_TYPES: Final = ("client", "responses")
#: The longest automatic acknowledgement delay (the engine's limit: a minute of silence is no acknowledgement).
MAX_ACKNOWLEDGEMENT_MS: Final = 60_000
#: The extension ``tool_choice`` of a ``client`` delegation.
CLIENT_TOOL_CHOICES: Final = ("auto", "required", "none")


def resolve_delegation(d: Delegation | None, *, current: Delegation | None) -> Delegation:
    """A start or update delegation -> the resolved delegation (``type``, ``responses``, ack delay).

    Only the shape is checked here; the tools and tool choice are read by the session, which knows what the engine
    runs (livekit_omni.live.delegation)."""
    kind = (current.type if current is not None else "client") if d is None else d.type
    if kind == "decisions":
        raise WireError(
            "unsupported_delegation",
            "decisions delegation is not supported by this server; supported: client, responses",
            param="session.delegation.type",
        )
    if kind not in DELEGATION_TYPES:
        raise WireError(
            "invalid_value",
            f"unknown delegation type {kind!r}; supported: client, responses",
            param="session.delegation.type",
        )
    if current is not None and current.type != kind:
        raise WireError(
            "immutable_field", "the delegation type cannot change", param="session.delegation.type"
        )
    delay = (current.acknowledgement_delay_ms or 0) if current is not None else 0
    if d is not None and d.acknowledgement_delay_ms is not None:
        if not 0 <= d.acknowledgement_delay_ms <= MAX_ACKNOWLEDGEMENT_MS:
            raise WireError(
                "invalid_value",
                f"acknowledgement_delay_ms is 0 to {MAX_ACKNOWLEDGEMENT_MS}",
                param="session.delegation.acknowledgement_delay_ms",
            )
        delay = d.acknowledgement_delay_ms
    choice = current.tool_choice if current is not None else None
    if d is not None and d.tool_choice is not None:
        if kind != "client":
            raise WireError(
                "invalid_value",
                "tool_choice is a client delegation setting; under responses delegation use responses.tool_choice",
                param="session.delegation.tool_choice",
            )
        if d.tool_choice not in CLIENT_TOOL_CHOICES:
            raise WireError(
                "invalid_value",
                f"tool_choice is one of {', '.join(CLIENT_TOOL_CHOICES)}",
                param="session.delegation.tool_choice",
            )
        choice = d.tool_choice
    responses: dict[str, Any] | None = None
    if kind == "responses":
        # Sparse on update: the keys given replace the current ones, the rest are kept.
        responses = dict(current.responses or {}) if current is not None else {}
        if d is not None and d.responses:
            responses.update(d.responses)
        instructions = responses.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise WireError(
                "invalid_type",
                "responses.instructions must be a string",
                param="session.delegation.responses.instructions",
            )
        if isinstance(instructions, str) and len(instructions) > MAX_INSTRUCTIONS_CHARS:
            raise WireError(
                "instructions_too_long",
                f"responses.instructions are limited to {MAX_INSTRUCTIONS_CHARS} characters",
                param="session.delegation.responses.instructions",
            )
    return Delegation(type=kind, responses=responses, acknowledgement_delay_ms=delay, tool_choice=choice)


def _unsupported_triggers() -> WireError:
    return WireError(
        "unsupported_triggers",
        "Decisions triggers need the Decisions API, which this server does not provide; send [] or omit them",
        param="session.triggers",
    )


def check_update(cfg: UpdateConfig, current_delegation: Delegation) -> Delegation | None:
    """Validate a ``session.update``; returns the new delegation (None: unchanged)."""
    for name in ("model", "instructions", "input", "audio", "client", "store", "safety_identifier"):
        if getattr(cfg, name) is not msgspec.UNSET:
            raise WireError(
                "immutable_field",
                f"session.{name} cannot change after the session has started; "
                "session.update accepts delegation and triggers only",
                param=f"session.{name}",
            )
    if isinstance(cfg.triggers, list) and cfg.triggers:
        raise _unsupported_triggers()
    if isinstance(cfg.delegation, msgspec.UnsetType):
        return None
    # null is "application delegation", i.e. the same type as now.
    return resolve_delegation(cfg.delegation, current=current_delegation)


def _resolve_input(items: list[InitialItem]) -> tuple[list[InitialItem], list[tuple[str, str]]]:
    if len(items) > MAX_INPUT_ITEMS:
        raise WireError(
            "too_many_items", f"input holds at most {MAX_INPUT_ITEMS} messages", param="session.input"
        )
    out: list[InitialItem] = []
    history: list[tuple[str, str]] = []
    total = 0
    for i, it in enumerate(items):
        p = f"session.input[{i}]"
        if it.role not in ("developer", "user", "assistant"):
            raise WireError(
                "invalid_value",
                f"role {it.role!r} is not allowed; use developer, user or assistant",
                param=f"{p}.role",
            )
        if len(it.content) != 1:
            raise WireError(
                "invalid_value", "each input message holds exactly one text part", param=f"{p}.content"
            )
        part = it.content[0]
        allowed = ("output_text", "text") if it.role == "assistant" else ("input_text",)
        if part.type is not None and part.type not in allowed:
            raise WireError(
                "invalid_value",
                f"a {it.role} part has type {' or '.join(allowed)}",
                param=f"{p}.content[0].type",
            )
        total += len(part.text)
        if total > MAX_INPUT_CHARS:
            raise WireError(
                "input_too_large",
                f"input holds at most {MAX_INPUT_CHARS} characters of text in all",
                param="session.input",
            )
        ptype = part.type or allowed[0]
        out.append(InitialItem(type="message", role=it.role, content=[TextPart(type=ptype, text=part.text)]))
        history.append((it.role, part.text))
    return out, history


def _resolve_client(client: ClientConfig | None) -> ClientConfig | None:
    """``client.data_channel`` permissions (WebRTC), with selectors reduced to the keys this server reads."""
    if client is None:
        return None
    dc = client.data_channel
    se = dc.allowed_server_events
    if isinstance(se, list):
        se = [ServerEventSelector(type=x.type, response_event=x.response_event) for x in se]
    return ClientConfig(
        data_channel=DataChannelPermissions(
            allowed_client_events=dc.allowed_client_events, allowed_server_events=se
        )
    )


class SessionResource(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The resolved configuration plus id, expiry and status: the ``session`` of started/updated/closed.

    ``instructions`` and ``input`` are echo-only; an event too large to send drops them (None is left out)."""

    id: str
    expires_at: int
    model: str
    #: Always "active", even in session.closed (the SDK's model requires it).
    status: Literal["active"]
    instructions: str | None = None
    input: list[InitialItem] | None = None
    audio: AudioConfig
    delegation: Delegation
    store: bool
    triggers: list[dict[str, Any]]
    safety_identifier: str | None = None
    client: ClientConfig | None = None
    #: What the engine's model adapter can do, as data (also in /health): ``owns_turn_taking`` (the model decides
    #: when to speak; no endpointing of ours), ``barge_in`` (talking over it cuts it off) ... An extension.
    capabilities: dict[str, bool] | None = None


def session_resource(
    cfg: ResolvedConfig, *, session_id: str, expires_at: int, capabilities: dict[str, bool] | None = None
) -> SessionResource:
    """The SessionResource of ``session.started``/``updated``/``closed``: the resolved config plus id etc."""
    return SessionResource(
        id=session_id,
        expires_at=expires_at,
        model=cfg.model,
        status="active",
        instructions=cfg.instructions,
        input=cfg.input,
        audio=AudioConfig(
            format=format_wire(cfg.format) if cfg.format is not None else None,
            output=AudioOutput(voice=cfg.voice),
        ),
        delegation=cfg.delegation,
        store=cfg.store,
        triggers=[],
        safety_identifier=cfg.safety_identifier,
        client=cfg.client,
        capabilities=capabilities,
    )


# --- server events --------------------------------------------------------------------------------------------

# A per-process random prefix plus a counter: unique across sessions and restarts, and cheap.
_id_prefix: Final = "evt_" + secrets.token_hex(4)
_id_counter = itertools.count(1)


def new_event_id() -> str:
    return f"{_id_prefix}{next(_id_counter):x}"


class _Event(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """A server event: a fresh ``event_id`` unless given, and the ``event_id`` of the command that caused it."""

    event_id: str = msgspec.field(default_factory=new_event_id)
    client_event_id: str | None = None


class SessionStarted(_Event, tag="session.started"):
    session: SessionResource
    #: An extension (stock clients ignore it): the single-use token that re-attaches to this session after a
    #: dropped connection (``session.resume``). Each ``session.started`` carries a fresh one; absent when resume
    #: is off (``resume_grace_s`` 0).
    resume_token: str | None = None


class SessionUpdated(_Event, tag="session.updated"):
    session: SessionResource


class InputAudioMuted(_Event, tag="session.input_audio.muted"):
    pass


class InputAudioUnmuted(_Event, tag="session.input_audio.unmuted"):
    pass


class FixturePlaying(_Event, tag="session.output_audio.fixture.playing"):
    pass


class FixturePlayed(_Event, tag="session.output_audio.fixture.played"):
    pass


class _Appended(_Event):
    """Where an appended context landed on the session timeline (``end_ms >= start_ms``)."""

    start_ms: int
    end_ms: int


class InstructionsAppended(_Appended, tag="session.instructions.appended"):
    pass


class ThinkingAppended(_Appended, tag="session.thinking.appended"):
    pass


class CommentaryAppended(_Appended, tag="session.commentary.appended"):
    pass


class OutputAudioDelta(
    msgspec.Struct, tag_field="type", tag="session.output_audio.delta", omit_defaults=True
):
    """Output audio in the session format. ``delta`` holds the raw bytes; on the wire it is base64. No
    ``event_id`` and (on the primary WebSocket) no timestamps: the SDK's model has neither."""

    delta: bytes
    start_ms: int | None = None
    end_ms: int | None = None


class _TranscriptDelta(_Event):
    delta: str
    start_ms: int
    end_ms: int


class InputTranscriptDelta(_TranscriptDelta, tag="session.input_transcript.delta"):
    """A fragment of the caller's speech. No turn boundaries and no "done" event."""


class OutputTranscriptDelta(_TranscriptDelta, tag="session.output_transcript.delta"):
    """A fragment of the model's speech, released with the audio it describes."""


class SessionUsage(msgspec.Struct, kw_only=True):
    #: Cumulative billable audio seconds of the session (never summed across events).
    seconds: float


class ContextWindow(msgspec.Struct, kw_only=True):
    usage_ratio: float


class UsageUpdated(_Event, tag="session.usage.updated"):
    usage: SessionUsage
    context_window: ContextWindow | None = None


CloseReason = Literal["close_requested", "expired", "content", "remote_hangup", "connection_lost"]


class SessionClosed(_Event, tag="session.closed"):
    """Terminal: nothing follows it, and the socket closes."""

    reason: CloseReason
    session: SessionResource
    usage: SessionUsage


class ErrorDetail(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    code: str
    message: str
    param: str | None = None
    client_event_id: str | None = None


class Error(_Event, tag="error"):
    error: ErrorDetail


class Info(_Event, tag="info"):
    code: str
    message: str


# --- delegation: session.delegation.created and the Responses backend's stream (response.event) ------------------


class DelegationInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Metadata only: the task is whatever the conversation says."""

    id: str
    target: Literal["client", "responses"]
    #: Always ``"delegation"`` (required on the wire, so it has no default for omit_defaults to drop).
    type: Literal["delegation"]
    #: The backend response of a ``responses`` delegation; left out for ``client``.
    response_id: str | None = None


class DelegationCreated(_Event, tag="session.delegation.created"):
    delegation: DelegationInfo
    #: Where on the session timeline (ms since it started) the model delegated.
    offset_ms: int


# The Responses streaming events a response.event carries (the openai SDK's ``ResponseStreamEvent`` members this
# server sends). Lifecycle snapshots clear ``instructions``, ``tools`` and ``output``, as the Live protocol says:
# clients read calls from ``response.output_item.done``. These structs are not omit_defaults where a field is
# required even when empty.


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponsesUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    """The backend's function call: ``arguments`` is JSON text valid for the tool's schema."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponsesResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A backend response snapshot (``object: "response"``), cleared as the protocol says."""

    id: str
    object: Literal["response"]
    created_at: float
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    output: list[FunctionCallItem]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    completed_at: float | None = None
    usage: ResponsesUsage | None = None


class _Nested(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponsesCreated(_Nested, tag="response.created"):
    response: ResponsesResponse


class ResponsesCompleted(_Nested, tag="response.completed"):
    response: ResponsesResponse


class ResponsesOutputItemAdded(_Nested, tag="response.output_item.added"):
    output_index: int
    item: FunctionCallItem


class ResponsesOutputItemDone(_Nested, tag="response.output_item.done"):
    output_index: int
    item: FunctionCallItem


class ResponsesFunctionCallArgumentsDelta(_Nested, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ResponsesFunctionCallArgumentsDone(_Nested, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


ResponsesStreamEvent = (
    ResponsesCreated
    | ResponsesCompleted
    | ResponsesOutputItemAdded
    | ResponsesOutputItemDone
    | ResponsesFunctionCallArgumentsDelta
    | ResponsesFunctionCallArgumentsDone
)


class ResponseEvent(_Event, tag="response.event"):
    """One event of the Responses backend's stream, with the delegation it belongs to (left out for a response the
    application started without one)."""

    event: ResponsesStreamEvent
    delegation_id: str | None = None


ServerEvent = (
    SessionStarted
    | SessionUpdated
    | InputAudioMuted
    | InputAudioUnmuted
    | FixturePlaying
    | FixturePlayed
    | InstructionsAppended
    | ThinkingAppended
    | CommentaryAppended
    | OutputAudioDelta
    | InputTranscriptDelta
    | OutputTranscriptDelta
    | UsageUpdated
    | SessionClosed
    | Error
    | Info
    | DelegationCreated
    | ResponseEvent
)
AppendedEvent = InstructionsAppended | ThinkingAppended | CommentaryAppended

#: Append command -> (engine AppendText kind, the server event that acknowledges it).
AppendKind = Literal["instructions", "thinking", "commentary"]
APPEND_KINDS: Final[dict[type[TextAppend], tuple[AppendKind, type[AppendedEvent]]]] = {
    InstructionsAppend: ("instructions", InstructionsAppended),
    ThinkingAppend: ("thinking", ThinkingAppended),
    CommentaryAppend: ("commentary", CommentaryAppended),
}


def event_type(ev: ServerEvent | ClientCommand) -> str:
    """The ``type`` tag of an event or command."""
    tag = ev.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def error_event(
    code: str,
    message: str,
    *,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    client_event_id: str | None = None,
) -> Error:
    return Error(
        client_event_id=client_event_id,
        error=ErrorDetail(
            type=type, code=code, message=message, param=param, client_event_id=client_event_id
        ),
    )


def error_from(e: WireError, client_event_id: str | None = None) -> Error:
    return error_event(
        e.code, e.message, type=e.type, param=e.param, client_event_id=e.client_event_id or client_event_id
    )


def usage(seconds: float) -> SessionUsage:
    return SessionUsage(seconds=float(seconds))


_encoder: Final = msgspec.json.Encoder()
_server_event_decoder: Final = msgspec.json.Decoder(ServerEvent)


def encode(ev: ServerEvent | ClientCommand) -> bytes:
    """One event or command as the JSON text of its frame."""
    return _encoder.encode(ev)


class UnknownServerEvent(Exception):
    """A frame that is a JSON object but not a server event of this protocol (a newer server's event, say)."""


def decode_server_event(raw: str | bytes) -> ServerEvent:
    """One text frame from the server -> its event.

    Raises :class:`UnknownServerEvent` for a JSON object this module does not know or that does not match its
    event's fields (a client may skip it), and ``msgspec.DecodeError`` for a frame that is not a JSON object at
    all (a broken server)."""
    try:
        return _server_event_decoder.decode(raw)
    except msgspec.ValidationError as e:
        failure = e
    if not isinstance(msgspec.json.decode(raw), dict):
        raise msgspec.DecodeError("the frame is JSON but not an object")
    raise UnknownServerEvent(str(failure))


#: The Live dialect's codec for the session core (livekit_omni.sessions.base).
CODEC: Final[WireCodec[ClientCommand, ServerEvent]] = WireCodec(
    decode_command, encode, event_type, error_event, Error
)
