"""vLLM-Omni 0.30's full-duplex WebSocket dialect, as far as the bridge speaks it.

Read from the 0.30.0 wheel: the client ``vllm_omni/clients/duplex.py`` (``DuplexClient``: handshake, appends,
``playback.ack``, resume, ``session.event_ack``), the handler ``vllm_omni/entrypoints/duplex/serving.py``
(``/v1/realtime?duplex=1`` and its alias ``/v1/duplex``), the command translation
``vllm_omni/engine/duplex/realtime_commands.py`` and the event projection
``vllm_omni/engine/duplex/realtime_events.py``. The parts that matter here:

* **Handshake.** The client opens ``…/v1/realtime?duplex=1&model=M&autostart=0`` and sends ``session.update``
  with the session object; the server answers ``session.created`` carrying ``session`` (its ``id``,
  ``capabilities``) and, for resumable models, ``resume_token`` + ``attachment_generation``. A refused open is
  an ``error`` event (``resource_exhausted`` when ``runtime.max_sessions`` is reached) and the socket closes.
* **Input.** ``input_audio_buffer.append`` with bare base64 ``audio``, ``format`` (``pcm16``/``pcm_f32le``),
  ``sample_rate_hz``, ``duration_ms`` and the cumulative ``audio_end_ms``. ``input_audio_buffer.commit`` ends a
  turn only for models that do not decide turns themselves.
* **Output.** ``response.created`` → ``response.output_audio.delta`` (base64 PCM16 ``delta``, its
  ``sample_rate_hz``, ``metadata.epoch``) each followed by ``response.output_audio_transcript.delta`` →
  ``response.done`` (``response.status`` ``completed`` or ``cancelled``). Caller text arrives as
  ``conversation.item.input_audio_transcription.completed``; the model's own VAD as
  ``input_audio_buffer.speech_started``/``speech_stopped``.
* **Barge-in.** The client sends ``barge_in``; the model may also cut itself off (its overlap policy, server
  VAD). Either way the session runner emits the internal ``audio.cancelled {cancelled_epoch, epoch,
  committed_ms}``, which reaches the wire as ``response.done`` with ``status: cancelled`` and that event as
  ``response.metadata`` (or only ``output_audio_buffer.cleared`` when the response had finished generating).
* **Playback.** ``playback.ack {played_ms, committed_ms, response_id}``: the history keeps what was heard.
* **Resume.** Every server event carries ``server_event_seq``; the client acknowledges it
  (``session.event_ack``). After a dropped socket the client reconnects and sends ``session.resume
  {session_id, resume_token, last_received_server_event_seq}``; the server answers ``session.resumed`` (a new
  ``resume_token``) and replays what was missed. ``session_resume_expired`` & co. are final.
* **Lease.** ``session.heartbeat`` keeps an idle session's lease alive; ``session.close`` ends it.
"""

from __future__ import annotations

import base64
from typing import Any, Final, Literal
from urllib.parse import urlencode, urlsplit, urlunsplit

import msgspec
import numpy as np
import numpy.typing as npt

#: Resume refusals after which reconnecting cannot help (``DuplexClient._FATAL_RESUME_CODES`` in the wheel).
FATAL_RESUME_CODES: Final = frozenset(
    {
        "invalid_session_resume",
        "session_resume_expired",
        "unsupported_session_resume",
        "invalid_resume_token",
        "session_resume_conflict",
    }
)
#: The open was refused for capacity (``DuplexSessionManager.open``: ``duplex_session_capacity_exhausted``).
CAPACITY_CODES: Final = frozenset({"resource_exhausted", "input_backpressure"})

InputFormat = Literal["pcm16", "pcm_f32le"]


def session_url(base_url: str, path: str, model: str) -> str:
    """The duplex endpoint URL, with the query the wheel's client sends (``DuplexClient._target_url``)."""
    parts = urlsplit(base_url)
    query = urlencode({"duplex": "1", "model": model, "autostart": "0"})
    return urlunsplit((parts.scheme or "ws", parts.netloc, path, query, ""))


# --- client events ---------------------------------------------------------------------------------------------


class _Command(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    event_id: str | None = None


class SessionUpdate(_Command, tag="session.update"):
    session: dict[str, Any]


class SessionResume(_Command, tag="session.resume"):
    session_id: str
    resume_token: str
    last_received_server_event_seq: int = 0


class EventAck(_Command, tag="session.event_ack"):
    server_event_seq: int


class AppendAudio(_Command, tag="input_audio_buffer.append"):
    audio: str
    format: InputFormat
    sample_rate_hz: int
    duration_ms: int
    audio_end_ms: int


class Commit(_Command, tag="input_audio_buffer.commit"):
    final: bool = True
    #: Ask for a response to this turn. A model that does not own its turns runs without ``auto_response`` (its
    #: plugin refuses it: Qwen3-Omni's ``validate_client_extra_body``), so each commit asks for the answer itself.
    create_response: bool | None = None


class BargeIn(_Command, tag="barge_in"):
    pass


class CancelResponse(_Command, tag="response.cancel"):
    response_id: str | None = None


class AckPlayback(_Command, tag="playback.ack"):
    played_ms: int
    committed_ms: int
    response_id: str | None = None


class Heartbeat(_Command, tag="session.heartbeat"):
    pass


class CloseSession(_Command, tag="session.close"):
    reason: str = "client_close"


Command = (
    SessionUpdate
    | SessionResume
    | EventAck
    | AppendAudio
    | Commit
    | BargeIn
    | CancelResponse
    | AckPlayback
    | Heartbeat
    | CloseSession
)

_encoder = msgspec.json.Encoder()


def encode(cmd: Command) -> str:
    return _encoder.encode(cmd).decode()


def session_payload(
    *,
    model: str,
    input_format: InputFormat,
    input_rate: int,
    output_rate: int,
    instructions: str,
    extra_session: dict[str, Any],
    extra_body: dict[str, Any],
    auto_response: bool = True,
) -> dict[str, Any]:
    """The ``session.update`` session object (``SessionConfig.to_session_payload`` in the wheel). ``auto_response``
    (the model answers without a ``response.create``) only for a model that owns its turns: Qwen3-Omni's plugin
    refuses the session with it (``invalid_duplex_runtime_config``)."""
    payload: dict[str, Any] = {
        "model": model,
        "modalities": ["audio", "text"],
        "input_audio_format": input_format,
        "output_audio_format": "pcm16",
        "sample_rate_hz": input_rate,
        "audio": {"input": {"sample_rate_hz": input_rate}, "output": {"sample_rate_hz": output_rate}},
        "turn_detection": None,
        **extra_session,
        "extra_body": {**({"auto_response": True} if auto_response else {}), **extra_body},
    }
    if instructions:
        payload["instructions"] = instructions
    return payload


# --- server events ---------------------------------------------------------------------------------------------

_decoder = msgspec.json.Decoder(dict[str, Any])


def decode_event(raw: str | bytes) -> dict[str, Any]:
    """One server frame as a mapping (the dialect adds fields freely; the adapter reads the ones it uses)."""
    return _decoder.decode(raw)


def error_code(ev: dict[str, Any]) -> tuple[str, str]:
    """(code, message) of an ``error`` event (``ErrorEvent.to_realtime``: ``{"error": {"code", "message"}}``)."""
    err = ev.get("error")
    if isinstance(err, dict):
        return str(err.get("code") or "internal_error"), str(err.get("message") or "")
    return "internal_error", str(err or "")


def response_id_of(ev: dict[str, Any]) -> str:
    rid = ev.get("response_id")
    if isinstance(rid, str):
        return rid
    resp = ev.get("response")
    if isinstance(resp, dict) and isinstance(resp.get("id"), str):
        return str(resp["id"])
    return ""


def event_epoch(ev: dict[str, Any]) -> int | None:
    """The model-side epoch an output event belongs to (``metadata.epoch`` on audio deltas)."""
    md = ev.get("metadata")
    if isinstance(md, dict) and isinstance(md.get("epoch"), int):
        return int(md["epoch"])
    return None


# --- audio -----------------------------------------------------------------------------------------------------


def encode_input(pcm: np.ndarray, fmt: InputFormat) -> str:
    """int16 samples, or float samples in [-1, 1] → base64 of the model's input encoding (little-endian)."""
    if pcm.dtype == np.int16:
        if fmt == "pcm16":
            raw = pcm.astype("<i2", copy=False).tobytes()
        else:
            raw = (pcm.astype(np.float32) * (1.0 / 32768.0)).astype("<f4").tobytes()
    elif fmt == "pcm_f32le":
        raw = pcm.astype("<f4").tobytes()
    else:
        raw = np.clip(np.rint(pcm * 32768.0), -32768, 32767).astype("<i2").tobytes()
    return base64.b64encode(raw).decode("ascii")


def decode_output(delta: str) -> npt.NDArray[np.int16]:
    """base64 PCM16 (the duplex lane's output format) → int16 samples; a trailing odd byte is dropped."""
    raw = base64.b64decode(delta)
    n = len(raw) // 2 * 2
    return np.frombuffer(raw[:n], dtype="<i2").astype(np.int16)
