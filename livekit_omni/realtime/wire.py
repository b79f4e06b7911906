"""The OpenAI Realtime dialect (GA) as this server speaks it: every client event and every server event, as types.

The one protocol module of the Realtime projection, as :mod:`livekit_omni.live.wire` is for Live: the session
(:mod:`livekit_omni.realtime.session`) decodes client events and encodes server events with these structs, and
the tests read the server's events back with the openai SDK's own types. docs/protocol.md (the Realtime section)
describes it for users.

* Client events are ``msgspec`` structs tagged by ``type``; unknown fields are ignored. ``session.update`` is
  sparse: a field left out keeps its value (``UNSET``), ``null`` resets it to the server default.
* Server events carry a fresh ``event_id``. Optional fields that are unset are left out of the JSON. Output audio
  (:class:`OutputAudioDelta`) holds raw bytes, which msgspec writes as base64 in C.
* Items and content parts are one struct each with optional fields (the dialect has a dozen item shapes that
  differ only in which fields are set); :func:`message_item` builds the message shapes.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Any, Final, Literal

import msgspec

from livekit_omni.sessions.codec import WireCodec
from livekit_omni.sessions.errors import INVALID_REQUEST as INVALID_REQUEST
from livekit_omni.sessions.errors import SERVER_ERROR as SERVER_ERROR
from livekit_omni.sessions.errors import WireError as WireError

UNSET: Final = msgspec.UNSET
Unset = msgspec.UnsetType

# --- session configuration --------------------------------------------------------------------------------------


class _Part(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class AudioFormat(_Part):
    type: str = "audio/pcm"
    rate: int | None = None


class TurnDetection(_Part):
    """``server_vad`` or ``semantic_vad``; ``null`` in the session is manual turn-taking."""

    type: str
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    idle_timeout_ms: int | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None
    eagerness: str | None = None


class Transcription(_Part):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class NoiseReduction(_Part):
    type: str | None = None


class AudioInput(_Part):
    format: AudioFormat | Unset = UNSET
    noise_reduction: NoiseReduction | Unset | None = UNSET
    transcription: Transcription | Unset | None = UNSET
    turn_detection: TurnDetection | Unset | None = UNSET


class AudioOutput(_Part):
    format: AudioFormat | Unset = UNSET
    voice: str | dict[str, Any] | Unset | None = UNSET
    speed: float | Unset | None = UNSET


class AudioConfig(_Part):
    input: AudioInput | Unset | None = UNSET
    output: AudioOutput | Unset | None = UNSET


class SessionConfig(_Part):
    """A ``session.update`` session: every field optional (sparse); also the resolved echo (all fields set)."""

    type: str | Unset = UNSET
    id: str | Unset = UNSET
    object: str | Unset = UNSET
    expires_at: int | Unset = UNSET
    model: str | Unset | None = UNSET
    instructions: str | Unset | None = UNSET
    output_modalities: list[str] | Unset | None = UNSET
    max_output_tokens: int | Literal["inf"] | Unset | None = UNSET
    #: Not in the GA session (the beta dialect had it): accepted as an extension, honoured, echoed once set.
    temperature: float | Unset | None = UNSET
    audio: AudioConfig | Unset | None = UNSET
    #: Function tools the model may call (docs/protocol.md, Realtime: Function tools).
    tools: list[dict[str, Any]] | Unset | None = UNSET
    tool_choice: str | dict[str, Any] | Unset | None = UNSET
    # Accepted, echoed, ignored.
    tracing: Any = UNSET
    truncation: Any = UNSET
    prompt: Any = UNSET
    reasoning: Any = UNSET
    include: Any = UNSET
    parallel_tool_calls: Any = UNSET


# --- items ------------------------------------------------------------------------------------------------------


class ContentPart(_Part):
    type: str | None = None
    text: str | None = None
    transcript: str | None = None
    audio: str | None = None
    image_url: str | None = None
    detail: str | None = None


class Item(_Part):
    """A conversation item: a message (``role``, ``content``), a function call or its output."""

    id: str | None = None
    #: Always set on the items the server sends (``message`` when a client's item leaves it out).
    type: str | None = None
    object: str | None = None
    status: str | None = None
    role: str | None = None
    content: list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


def message_item(item_id: str, role: str, parts: list[ContentPart], *, status: str = "completed") -> Item:
    return Item(id=item_id, type="message", object="realtime.item", status=status, role=role, content=parts)


# --- client events ----------------------------------------------------------------------------------------------


class _Cmd(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    event_id: str | None = None


class SessionUpdate(_Cmd, tag="session.update"):
    session: SessionConfig


class InputAudioAppend(_Cmd, tag="input_audio_buffer.append"):
    audio: str


class InputAudioCommit(_Cmd, tag="input_audio_buffer.commit"):
    pass


class InputAudioClear(_Cmd, tag="input_audio_buffer.clear"):
    pass


class OutputAudioClear(_Cmd, tag="output_audio_buffer.clear"):
    pass


class ItemCreate(_Cmd, tag="conversation.item.create"):
    item: Item
    previous_item_id: str | None = None


class ItemRetrieve(_Cmd, tag="conversation.item.retrieve"):
    item_id: str


class ItemTruncate(_Cmd, kw_only=True, tag="conversation.item.truncate"):
    item_id: str
    content_index: int = 0
    #: An int in the SDK's types; a fractional value is floored rather than refused.
    audio_end_ms: float


class ItemDelete(_Cmd, tag="conversation.item.delete"):
    item_id: str


class ResponseParams(_Part):
    instructions: str | None = None
    output_modalities: list[str] | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    metadata: dict[str, Any] | None = None
    #: ``"auto"`` (the default conversation) or ``"none"`` (out of band).
    conversation: str | None = None
    input: list[Item] | None = None
    audio: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    prompt: Any = None
    reasoning: Any = None


class ResponseCreate(_Cmd, tag="response.create"):
    response: ResponseParams | None = None


class ResponseCancel(_Cmd, tag="response.cancel"):
    response_id: str | None = None


ClientEvent = (
    SessionUpdate
    | InputAudioAppend
    | InputAudioCommit
    | InputAudioClear
    | OutputAudioClear
    | ItemCreate
    | ItemRetrieve
    | ItemTruncate
    | ItemDelete
    | ResponseCreate
    | ResponseCancel
)

_KNOWN_TYPES: Final = frozenset(
    t.__struct_config__.tag
    for t in (
        SessionUpdate,
        InputAudioAppend,
        InputAudioCommit,
        InputAudioClear,
        OutputAudioClear,
        ItemCreate,
        ItemRetrieve,
        ItemTruncate,
        ItemDelete,
        ResponseCreate,
        ResponseCancel,
    )
)


class _Envelope(msgspec.Struct):
    type: Any = None
    event_id: Any = None


_client_decoder: Final = msgspec.json.Decoder(ClientEvent)
_envelope_decoder: Final = msgspec.json.Decoder(_Envelope)


def decode_client_event(raw: str | bytes) -> ClientEvent:
    """One text frame -> a client event, or a :class:`WireError` naming what is wrong (the session goes on)."""
    try:
        return _client_decoder.decode(raw)
    except msgspec.ValidationError as e:
        failure: Exception = e
    except msgspec.DecodeError as e:
        failure = e
    except RecursionError:
        raise WireError("invalid_json", "the message nests JSON too deeply") from None
    except UnicodeDecodeError:
        # msgspec raises this (not DecodeError) for a binary frame that is not UTF-8.
        raise WireError("invalid_json", "the message is not valid UTF-8") from None
    try:
        env = _envelope_decoder.decode(raw)
    except msgspec.ValidationError:
        raise WireError("invalid_json", "the message must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        raise WireError("invalid_json", "the message is not valid JSON") from None
    cid = env.event_id if isinstance(env.event_id, str) else None
    if not isinstance(env.type, str) or env.type not in _KNOWN_TYPES:
        shown = env.type[:100] if isinstance(env.type, str) else env.type
        raise WireError("invalid_value", f"unknown event type {shown!r}", param="type", client_event_id=cid)
    text = str(failure)
    param = None
    if "- at `$." in text:
        param = text.rsplit("- at `$.", 1)[1].rstrip("`")
    if text.startswith("Object missing required field `"):
        field = text.split("`", 2)[1]
        param = f"{param}.{field}" if param else field
    raise WireError(
        "missing_required_parameter" if text.startswith("Object missing required field") else "invalid_value",
        f"invalid {env.type}: {failure}",
        param=param,
        client_event_id=cid,
    )


# --- server events ----------------------------------------------------------------------------------------------

_id_prefix: Final = secrets.token_hex(3)
_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    """A unique id with the dialect's prefixes (``event_``, ``item_``, ``resp_``, ...)."""
    return f"{prefix}_{_id_prefix}{next(_counter):x}"


def _event_id() -> str:
    return new_id("event")


class _Event(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    event_id: str = msgspec.field(default_factory=_event_id)


class SessionCreated(_Event, tag="session.created"):
    session: SessionConfig


class SessionUpdated(_Event, tag="session.updated"):
    session: SessionConfig


class SpeechStarted(_Event, tag="input_audio_buffer.speech_started"):
    audio_start_ms: int
    item_id: str


class SpeechStopped(_Event, tag="input_audio_buffer.speech_stopped"):
    audio_end_ms: int
    item_id: str


class InputCommitted(_Event, tag="input_audio_buffer.committed"):
    item_id: str
    previous_item_id: str | None = None


class InputCleared(_Event, tag="input_audio_buffer.cleared"):
    pass


class TimeoutTriggered(_Event, tag="input_audio_buffer.timeout_triggered"):
    audio_start_ms: int
    audio_end_ms: int
    item_id: str


class DtmfEventReceived(_Event, tag="input_audio_buffer.dtmf_event_received"):
    """A SIP caller's keypad press (``0``-``9``, ``*``, ``#``, ``A``-``D``); ``received_at`` in Unix seconds."""

    event: str
    received_at: int


class ItemAdded(_Event, tag="conversation.item.added"):
    item: Item
    previous_item_id: str | None = None


class ItemDone(_Event, tag="conversation.item.done"):
    item: Item
    previous_item_id: str | None = None


class ItemRetrieved(_Event, tag="conversation.item.retrieved"):
    item: Item


class ItemTruncated(_Event, omit_defaults=False, tag="conversation.item.truncated"):
    item_id: str
    content_index: int
    audio_end_ms: int


class ItemDeleted(_Event, tag="conversation.item.deleted"):
    item_id: str


class OutputAudioBufferStarted(_Event, tag="output_audio_buffer.started"):
    """WebRTC only: the response's audio began on the media track."""

    response_id: str


class OutputAudioBufferStopped(_Event, tag="output_audio_buffer.stopped"):
    """WebRTC only: the response's audio has all played (after its ``response.done``)."""

    response_id: str


class OutputAudioBufferCleared(_Event, tag="output_audio_buffer.cleared"):
    """WebRTC only: the response's audio was cut (a barge-in or the client's ``output_audio_buffer.clear``)."""

    response_id: str


class DurationUsage(msgspec.Struct, kw_only=True):
    type: Literal["duration"] = "duration"
    seconds: float


class TranscriptionDelta(
    _Event, kw_only=True, omit_defaults=False, tag="conversation.item.input_audio_transcription.delta"
):
    item_id: str
    content_index: int = 0
    delta: str


class TranscriptionCompleted(
    _Event, kw_only=True, omit_defaults=False, tag="conversation.item.input_audio_transcription.completed"
):
    item_id: str
    content_index: int = 0
    transcript: str
    usage: DurationUsage


class InputTokenDetails(msgspec.Struct, kw_only=True):
    text_tokens: int = 0
    audio_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0


class OutputTokenDetails(msgspec.Struct, kw_only=True):
    text_tokens: int = 0
    audio_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    total_tokens: int
    input_tokens: int
    output_tokens: int
    input_token_details: InputTokenDetails
    output_token_details: OutputTokenDetails


class StatusError(_Part):
    type: str
    code: str | None = None
    message: str | None = None


class StatusDetails(_Part):
    type: str
    reason: str | None = None
    #: Why a ``failed`` response failed.
    error: StatusError | None = None


class Response(_Part, kw_only=True):
    id: str
    object: str = "realtime.response"
    status: str
    status_details: StatusDetails | None = None
    output: list[Item] = msgspec.field(default_factory=list)
    conversation_id: str | None = None
    output_modalities: list[str] | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    metadata: dict[str, Any] | None = None
    usage: ResponseUsage | None = None


class ResponseCreated(_Event, tag="response.created"):
    response: Response


class ResponseDone(_Event, tag="response.done"):
    response: Response


class _InResponse(_Event, kw_only=True, omit_defaults=False):
    """An event inside a response. Its indexes are always sent (0 included): the SDK requires them."""

    response_id: str
    output_index: int = 0


class OutputItemAdded(_InResponse, kw_only=True, tag="response.output_item.added"):
    item: Item


class OutputItemDone(_InResponse, kw_only=True, tag="response.output_item.done"):
    item: Item


class _InPart(_InResponse, kw_only=True):
    item_id: str
    content_index: int = 0


class Part(_Part):
    type: str
    text: str | None = None
    transcript: str | None = None


class ContentPartAdded(_InPart, kw_only=True, tag="response.content_part.added"):
    part: Part


class ContentPartDone(_InPart, kw_only=True, tag="response.content_part.done"):
    part: Part


class OutputAudioDelta(_InPart, kw_only=True, tag="response.output_audio.delta"):
    #: Raw audio in the session's output format; base64 on the wire.
    delta: bytes


class OutputAudioDone(_InPart, kw_only=True, tag="response.output_audio.done"):
    pass


class OutputAudioTranscriptDelta(_InPart, kw_only=True, tag="response.output_audio_transcript.delta"):
    delta: str


class OutputAudioTranscriptDone(_InPart, kw_only=True, tag="response.output_audio_transcript.done"):
    transcript: str


class OutputTextDelta(_InPart, kw_only=True, tag="response.output_text.delta"):
    delta: str


class OutputTextDone(_InPart, kw_only=True, tag="response.output_text.done"):
    text: str


class FunctionCallArgumentsDelta(_InResponse, kw_only=True, tag="response.function_call_arguments.delta"):
    item_id: str
    call_id: str
    delta: str


class FunctionCallArgumentsDone(_InResponse, kw_only=True, tag="response.function_call_arguments.done"):
    item_id: str
    call_id: str
    name: str
    arguments: str


class ErrorDetail(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    code: str | None = None
    message: str
    param: str | None = None
    event_id: str | None = None


class Error(_Event, tag="error"):
    error: ErrorDetail


ServerEvent = (
    SessionCreated
    | SessionUpdated
    | SpeechStarted
    | SpeechStopped
    | InputCommitted
    | InputCleared
    | TimeoutTriggered
    | DtmfEventReceived
    | ItemAdded
    | ItemDone
    | ItemRetrieved
    | ItemTruncated
    | ItemDeleted
    | TranscriptionDelta
    | TranscriptionCompleted
    | ResponseCreated
    | ResponseDone
    | OutputItemAdded
    | OutputItemDone
    | ContentPartAdded
    | ContentPartDone
    | OutputAudioDelta
    | OutputAudioDone
    | OutputAudioTranscriptDelta
    | OutputAudioTranscriptDone
    | OutputTextDelta
    | OutputTextDone
    | FunctionCallArgumentsDelta
    | FunctionCallArgumentsDone
    | OutputAudioBufferStarted
    | OutputAudioBufferStopped
    | OutputAudioBufferCleared
    | Error
)


def error_event(
    code: str,
    message: str,
    *,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    client_event_id: str | None = None,
) -> Error:
    return Error(
        error=ErrorDetail(type=type, code=code, message=message, param=param, event_id=client_event_id)
    )


def error_from(e: WireError, client_event_id: str | None = None) -> Error:
    return error_event(
        e.code, e.message, type=e.type, param=e.param, client_event_id=e.client_event_id or client_event_id
    )


_encoder: Final = msgspec.json.Encoder()


def encode(ev: ServerEvent | ClientEvent) -> bytes:
    return _encoder.encode(ev)


def event_type(ev: ServerEvent | ClientEvent) -> str:
    tag = ev.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


#: The Live dialect's codec for the session core (livekit_omni.sessions.base).
CODEC: Final[WireCodec[ClientEvent, ServerEvent]] = WireCodec(
    decode_client_event, encode, event_type, error_event, Error
)
