"""Wire models of the OpenAI Live facade: every client command it decodes and every server event it builds.

Client commands are ``msgspec`` structs tagged by ``type``; unknown fields are ignored (docs/protocol.md:
a compatible server SHOULD ignore them). :func:`decode_command` turns one text frame into a command or a
:class:`WireError` that names the problem, so the session answers with an ``error`` event and goes on.

Server events are plain dicts built by the functions at the bottom, each with a fresh ``event_id`` (and
``client_event_id`` when the command that caused it had one), encoded by :func:`encode`. Audio deltas, the only
hot path, are built as bytes directly.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

# --- errors ---------------------------------------------------------------------------------------------------

INVALID_REQUEST: Final = "invalid_request_error"
SERVER_ERROR: Final = "server_error"


class WireError(Exception):
    """A command the server refuses; becomes an ``error`` event. ``fatal``: the session cannot go on."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        client_event_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.type = type
        self.client_event_id = client_event_id


# --- client commands ------------------------------------------------------------------------------------------


class _Cmd(msgspec.Struct, tag_field="type", kw_only=True):
    event_id: str | None = None


class TextPart(msgspec.Struct, kw_only=True):
    text: str
    type: str | None = None


class InitialItem(msgspec.Struct, kw_only=True):
    role: str
    content: list[TextPart]
    type: str | None = None
    id: str | None = None
    status: str | None = None


class AudioFormat(msgspec.Struct, kw_only=True):
    type: str
    rate: int | None = None


class AudioOutput(msgspec.Struct, kw_only=True):
    # A built-in name, any string, or a custom voice ``{"id": "voice_..."}``.
    voice: str | dict[str, Any] | None = None


class AudioConfig(msgspec.Struct, kw_only=True):
    format: AudioFormat | None = None
    output: AudioOutput | None = None


class Delegation(msgspec.Struct, kw_only=True):
    type: str
    acknowledgement_delay_ms: int | None = None


class StartConfig(msgspec.Struct, kw_only=True):
    model: str
    instructions: str | None = None
    input: list[InitialItem] | None = None
    audio: AudioConfig | None = None
    delegation: Delegation | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    triggers: list[dict[str, Any]] | None = None
    client: dict[str, Any] | None = None


class UpdateConfig(msgspec.Struct, kw_only=True):
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
    | SessionClose
)
TextAppend = InstructionsAppend | ThinkingAppend | CommentaryAppend

#: Append command -> (engine AppendText kind, server acknowledgement type).
APPEND_KINDS: Final[dict[type, tuple[str, str]]] = {
    InstructionsAppend: ("instructions", "session.instructions.appended"),
    ThinkingAppend: ("thinking", "session.thinking.appended"),
    CommentaryAppend: ("commentary", "session.commentary.appended"),
}

#: Commands of the Live protocol this server knows but does not serve, with the reason given to the client.
UNSUPPORTED_COMMANDS: Final[dict[str, str]] = {
    "response.item.create": "needs responses delegation; this server supports client delegation only",
    "response.create": "needs responses delegation; this server supports client delegation only",
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
        SessionClose,
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
    # Slow path, errors only: find out what kind of wrong it is.
    try:
        env = _envelope_decoder.decode(raw)
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise WireError("invalid_json", "the message must be a JSON object") from None
    except msgspec.DecodeError:
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


# --- audio formats --------------------------------------------------------------------------------------------

Encoding = Literal["pcm16", "pcmu", "pcma"]


@dataclass(frozen=True, slots=True)
class WireFormat:
    """A session audio format: the encoding on the wire and its sample rate."""

    encoding: Encoding
    rate: int

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.encoding == "pcm16" else 1

    def wire(self) -> dict[str, Any]:
        names = {"pcm16": "audio/pcm", "pcmu": "audio/pcmu", "pcma": "audio/pcma"}
        return {"type": names[self.encoding], "rate": self.rate}


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


def decode_audio(b64: str, fmt: WireFormat, *, param: str = "audio") -> bytes:
    """Base64 audio in ``fmt`` -> raw bytes, checked for whole samples."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise WireError("invalid_audio", "audio is not valid base64", param=param) from None
    if len(raw) % fmt.bytes_per_sample:
        raise WireError(
            "invalid_audio",
            f"audio has {len(raw)} bytes, not a whole number of 16-bit samples",
            param=param,
        )
    return raw


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
    input: list[dict[str, Any]]
    history: list[tuple[str, str]]  # (role, text) for the engine
    format: WireFormat | None  # None on WebRTC (negotiated)
    voice: str | dict[str, Any]
    delegation: dict[str, Any]
    store: bool
    store_requested: bool
    safety_identifier: str | None
    client: dict[str, Any] | None

    @property
    def voice_name(self) -> str:
        v = self.voice
        return v if isinstance(v, str) else str(v.get("id", ""))


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
    voice: str | dict[str, Any] = DEFAULT_VOICE
    if audio.output is not None and audio.output.voice is not None:
        voice = audio.output.voice
        if isinstance(voice, dict) and not isinstance(voice.get("id"), str):
            raise WireError(
                "invalid_value", "a custom voice is {id: string}", param="session.audio.output.voice"
            )
        if isinstance(voice, dict):
            voice = {"id": voice["id"]}
    client = _resolve_client(cfg.client)
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
        client=client,
    )


def resolve_delegation(d: Delegation | None, *, current: dict[str, Any] | None) -> dict[str, Any]:
    """A start or update delegation -> the resolved ``{type: "client", acknowledgement_delay_ms}``."""
    kind = "client" if d is None else d.type
    if kind in ("responses", "decisions"):
        raise WireError(
            "unsupported_delegation",
            f"{kind} delegation is not supported by this server; supported: client",
            param="session.delegation.type",
        )
    if kind != "client":
        raise WireError(
            "invalid_value",
            f"unknown delegation type {kind!r}; supported: client",
            param="session.delegation.type",
        )
    if current is not None and current.get("type") != kind:
        raise WireError(
            "immutable_field", "the delegation type cannot change", param="session.delegation.type"
        )
    delay = current.get("acknowledgement_delay_ms", 0) if current else 0
    if d is not None and d.acknowledgement_delay_ms is not None:
        if d.acknowledgement_delay_ms < 0:
            raise WireError(
                "invalid_value",
                "acknowledgement_delay_ms must be >= 0",
                param="session.delegation.acknowledgement_delay_ms",
            )
        delay = d.acknowledgement_delay_ms
    return {"type": "client", "acknowledgement_delay_ms": delay}


def _unsupported_triggers() -> WireError:
    return WireError(
        "unsupported_triggers",
        "Decisions triggers need the Decisions API, which this server does not provide; send [] or omit them",
        param="session.triggers",
    )


def check_update(cfg: UpdateConfig, current_delegation: dict[str, Any]) -> dict[str, Any] | None:
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
    if cfg.delegation is msgspec.UNSET:
        return None
    # null is "application delegation", i.e. the same type as now.
    return resolve_delegation(cfg.delegation, current=current_delegation)


def _resolve_input(items: list[InitialItem]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    if len(items) > MAX_INPUT_ITEMS:
        raise WireError(
            "too_many_items", f"input holds at most {MAX_INPUT_ITEMS} messages", param="session.input"
        )
    out: list[dict[str, Any]] = []
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
        out.append({"type": "message", "role": it.role, "content": [{"type": ptype, "text": part.text}]})
        history.append((it.role, part.text))
    return out, history


def _resolve_client(client: dict[str, Any] | None) -> dict[str, Any] | None:
    """``client.data_channel`` permissions (WebRTC): "all" or a list per direction."""
    if client is None:
        return None
    dc = client.get("data_channel")
    if not isinstance(dc, dict):
        raise WireError(
            "invalid_value", "client is {data_channel: {...}}", param="session.client.data_channel"
        )
    out: dict[str, Any] = {}
    ce = dc.get("allowed_client_events")
    if ce is not None:
        if not (ce == "all" or (isinstance(ce, list) and all(isinstance(x, str) for x in ce))):
            raise WireError(
                "invalid_value",
                'allowed_client_events is "all" or a list of event types',
                param="session.client.data_channel.allowed_client_events",
            )
        out["allowed_client_events"] = ce
    se = dc.get("allowed_server_events")
    if se is not None:
        ok = se == "all" or (
            isinstance(se, list) and all(isinstance(x, dict) and isinstance(x.get("type"), str) for x in se)
        )
        if not ok:
            raise WireError(
                "invalid_value",
                'allowed_server_events is "all" or a list of {type} selectors',
                param="session.client.data_channel.allowed_server_events",
            )
        out["allowed_server_events"] = (
            se
            if se == "all"
            else [{k: v for k, v in x.items() if k in ("type", "response_event")} for x in se]
        )
    return {"data_channel": out}


def session_resource(
    cfg: ResolvedConfig, *, session_id: str, expires_at: int, triggers: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The SessionResource of ``session.started``/``updated``/``closed``: the resolved config plus id etc."""
    audio: dict[str, Any] = {"output": {"voice": cfg.voice}}
    if cfg.format is not None:
        audio["format"] = cfg.format.wire()
    res: dict[str, Any] = {
        "id": session_id,
        "expires_at": expires_at,
        "model": cfg.model,
        "status": "active",
        "instructions": cfg.instructions,
        "input": cfg.input,
        "audio": audio,
        "delegation": cfg.delegation,
        "store": cfg.store,
        "triggers": triggers or [],
    }
    if cfg.safety_identifier is not None:
        res["safety_identifier"] = cfg.safety_identifier
    if cfg.client is not None:
        res["client"] = cfg.client
    return res


# --- server events --------------------------------------------------------------------------------------------

# A per-process random prefix plus a counter: unique across sessions and restarts, and cheap.
_id_prefix: Final = "evt_" + secrets.token_hex(4)
_id_counter = itertools.count(1)
_encoder: Final = msgspec.json.Encoder()


def new_event_id() -> str:
    return f"{_id_prefix}{next(_id_counter):x}"


def event(type: str, client_event_id: str | None = None, /, **fields: Any) -> dict[str, Any]:
    ev: dict[str, Any] = {"type": type, "event_id": new_event_id(), **fields}
    if client_event_id is not None:
        ev["client_event_id"] = client_event_id
    return ev


def error_event(
    code: str,
    message: str,
    *,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    client_event_id: str | None = None,
) -> dict[str, Any]:
    err: dict[str, Any] = {"type": type, "code": code, "message": message}
    if param is not None:
        err["param"] = param
    if client_event_id is not None:
        err["client_event_id"] = client_event_id
    return event("error", client_event_id, error=err)


def error_from(e: WireError, client_event_id: str | None = None) -> dict[str, Any]:
    return error_event(
        e.code, e.message, type=e.type, param=e.param, client_event_id=e.client_event_id or client_event_id
    )


def info_event(code: str, message: str) -> dict[str, Any]:
    return event("info", None, code=code, message=message)


def usage(seconds: float) -> dict[str, Any]:
    return {"seconds": float(seconds)}


def transcript_delta(
    kind: Literal["input", "output"], text: str, start_ms: int, end_ms: int
) -> dict[str, Any]:
    return event(
        f"session.{kind}_transcript.delta", None, delta=text, start_ms=start_ms, end_ms=max(start_ms, end_ms)
    )


def encode(ev: dict[str, Any]) -> bytes:
    return _encoder.encode(ev)


_AUDIO_HEAD: Final = b'{"type":"session.output_audio.delta","delta":"'


def audio_delta_bytes(raw: bytes) -> bytes:
    """The encoded ``session.output_audio.delta`` for ``raw`` audio (no event_id: the SDK model has none)."""
    return _AUDIO_HEAD + base64.b64encode(raw) + b'"}'
