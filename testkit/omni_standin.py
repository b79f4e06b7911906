"""A stand-in for a ``vllm-omni serve`` duplex sidecar, for tests and benchmarks (not the product; no model).

It speaks vLLM-Omni 0.30's duplex WebSocket dialect on ``/v1/realtime?duplex=1`` and ``/v1/duplex``, as read from
the 0.30.0 wheel (``vllm_omni/entrypoints/duplex/serving.py`` for the handshake, resume, replay and
``session.event_ack``; ``vllm_omni/engine/duplex/realtime_events.py`` for how the session runner's internal events,
``audio.cancelled`` included, are projected onto the wire; ``vllm_omni/protocol/duplex/errors.py`` for error
codes). Each event it sends has the key set the wheel's own event class renders (``to_realtime()`` of
``vllm_omni.protocol.duplex.events``), and it was driven end to end by the wheel's own client,
``vllm_omni.clients.duplex.DuplexClient`` (handshake, appends, responses, audio, ``playback.ack``, ``barge_in``,
a dropped socket resumed with ``session.resume``): see docs/omni-models.md, "The stand-in".

What it does instead of a model, per session:

* **turns**: with ``--turns model`` (a model that owns turn-taking, like MiniCPM-o) an energy gate on the caller's
  audio finds the end of an utterance (``--silence-ms`` of quiet after speech) and the stand-in answers on its
  own; with ``--turns commit`` it answers on ``input_audio_buffer.commit``. Its caller transcript says how long
  the utterance was (``"heard 800 ms"``).
* **replies**: ``--reply-ms`` of a ``--tone-hz`` sine at ``--output-rate``, in ``--unit-ms`` deltas paced at real
  time, each followed by a transcript delta (one word per delta).
* **barge-in**: ``barge_in`` (or ``response.cancel``) cuts the reply: the epoch advances and the reply ends as
  ``response.done`` with ``status: cancelled`` and the ``audio.cancelled`` event (``cancelled_epoch``, ``epoch``,
  ``committed_ms`` = the last ``playback.ack``) as its metadata. With ``--overlap-barge-in-ms`` the model cuts
  itself off the same way when the caller talks over it that long (its overlap policy).
* **capacity**: past ``--max-sessions`` an open is refused with ``resource_exhausted`` and the socket closes.
* **resume**: a dropped socket leaves the session alive for ``--grace-s``; ``session.resume`` with the resume token
  re-attaches it and replays the journal after ``last_received_server_event_seq``.

Validation: what vLLM-Omni's handler refuses after the handshake it refuses too, with the same ``error``
(:func:`refusal`; tests/test_omni_bridge_real.py compares the two). The wire is tested against the wheel's own
handler there; the stand-in is for faults (a crash, a dropped socket, the model's overlap policy) and the benchmark.

Control endpoints for tests: ``GET /standin/state`` (what it received: appends, acks, barge-ins, resumes),
``POST /standin/speak`` (model-initiated speech on every session, or ``?session=<id>``), ``POST /standin/drop``
(drop every socket, keep the sessions: exercises resume). ``GET /health`` answers 200 like vLLM's.

Run: ``python -m testkit.omni_standin --port 8091``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import gc
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

log = logging.getLogger("omni_standin")


@dataclass
class StandinConfig:
    max_sessions: int = 4
    turns: str = "model"  # model | commit
    silence_ms: int = 400
    reply_ms: int = 1200
    unit_ms: int = 80
    output_rate: int = 24_000
    tone_hz: float = 660.0
    overlap_barge_in_ms: int = 0
    grace_s: float = 30.0
    #: Speech threshold of the energy gate, as RMS of float samples in [-1, 1].
    speech_rms: float = 0.02
    supports_barge_in: bool = True
    #: Benchmark mode: every append comes straight back as output audio (one endless response), so the round
    #: trip measures the bridge, not a model.
    echo: bool = False


def _event_id() -> str:
    return "event_" + secrets.token_hex(12)


def error_payload(code: str, message: str, *, error_type: str = "invalid_request_error") -> dict[str, Any]:
    """``vllm_omni.protocol.duplex.events.error_event(code, message).to_realtime()``."""
    return {
        "type": "error",
        "event_id": _event_id(),
        "error": {"type": error_type, "code": code, "message": message},
    }


ERROR_TYPES = {
    "resource_exhausted": "rate_limit_error",
    "session_resume_expired": "invalid_request_error",
    "invalid_resume_token": "invalid_request_error",
    "bad_event": "invalid_request_error",
}


#: Every client event type vLLM-Omni 0.30's handler takes after the handshake (``translate_realtime_command`` in
#: ``engine/duplex/realtime_commands.py``, plus the envelope's own ``session.event_ack``); anything else is
#: ``unknown_event``. The stand-in acts on a few of them and ignores the rest, as a model without the feature would.
KNOWN_EVENTS = frozenset(
    {
        "session.update",
        "session.event_ack",
        "conversation.item.create",
        "conversation.item.delete",
        "conversation.item.truncate",
        "conversation.item.retrieve",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input.commit",
        "input_audio_buffer.clear",
        "output_audio_buffer.clear",
        "response.cancel",
        "response.create",
        "playback.ack",
        "audio.playback_ack",
        "session.heartbeat",
        "session.close",
        "close",
        "close_session",
        "input.text.append",
        "input_text.append",
        "push_text",
        "input.cancel",
        "barge_in",
        "turn.signal",
        "signal_turn",
    }
)
#: ``REALTIME_INPUT_AUDIO_FORMATS`` after ``parse_realtime_audio_format``'s aliases (``protocol/realtime/formats.py``).
INPUT_FORMATS = frozenset(
    {"pcm16", "pcm_s16le", "s16le", "pcm", "audio/pcm", "pcm_f32le", "f32le", "audio/pcm_f32le"}
)


def refusal(msg: object) -> tuple[str, str] | None:
    """(code, message) of the ``error`` vLLM-Omni 0.30's handler answers a client event with after the handshake
    (``OmniDuplexSessionHandler._read_loop``, ``RealtimeEnvelope.translate``, ``decode_audio_append``), or None when
    it takes the event. Covers the checks the bridge's events could trip; tests/test_omni_bridge_real.py sends the
    same bad events to the wheel's handler and to the stand-in and compares the answers."""
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        return "bad_event", "Duplex event must be a JSON object with a type"
    kind = msg["type"]
    if kind == "session.resume":
        return "unsupported_session_resume", "session.resume must be the first message of a new connection"
    if kind not in KNOWN_EVENTS:
        return "unknown_event", f"Unknown duplex event type: {kind}"
    if kind == "session.event_ack":
        seq = msg.get("server_event_seq")
        if not isinstance(seq, int) or seq < 0:
            return "invalid_event_ack", "session.event_ack requires a non-negative server_event_seq"
    elif kind in ("playback.ack", "audio.playback_ack"):
        played = msg.get("played_ms")
        if not isinstance(played, int | float):
            return "bad_event", "playback.ack requires numeric played_ms"
    elif kind == "input_audio_buffer.append":
        audio = msg.get("audio") or msg.get("delta")
        if not isinstance(audio, str) or not audio:
            if not msg.get("video_frames"):
                return "bad_event", "input_audio_buffer.append requires audio and/or video_frames"
            return None
        fmt = msg.get("format") or msg.get("input_audio_format")
        if isinstance(fmt, str) and fmt.lower() not in INPUT_FORMATS:
            return "unsupported_audio_format", f"Unsupported input_audio_format: {fmt}"
        try:
            base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            return "bad_audio", "input audio is not valid base64"
    return None


@dataclass
class StandinSession:
    id: str
    token: str
    config: dict[str, Any]
    generation: int = 1
    epoch: int = 0
    seq: int = 0
    journal: list[dict[str, Any]] = field(default_factory=list)
    ws: web.WebSocketResponse | None = None
    detached_at: float | None = None
    closed: bool = False
    # input
    input_format: str = "pcm16"
    input_rate: int = 16_000
    received_ms: float = 0.0
    appends: int = 0
    peak_rms: float = 0.0
    voiced_ms: int = 0
    quiet_ms: int = 0
    speech_start_ms: int = 0
    overlap_ms: int = 0
    # output
    response_id: str | None = None
    response_task: asyncio.Task[None] | None = None
    sent_ms: float = 0.0
    generating: bool = False
    responses: int = 0
    # what the tests read back
    acks: list[dict[str, Any]] = field(default_factory=list)
    barge_ins: list[dict[str, Any]] = field(default_factory=list)
    resumes: int = 0
    event_acks: int = 0
    heartbeats: int = 0
    commits: int = 0

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "appends": self.appends,
            "peak_rms": round(self.peak_rms, 4),
            "received_ms": round(self.received_ms),
            "input_format": self.input_format,
            "input_rate": self.input_rate,
            "epoch": self.epoch,
            "responses": self.responses,
            "acks": self.acks[-50:],
            "ack_count": len(self.acks),
            "barge_ins": self.barge_ins,
            "resumes": self.resumes,
            "event_acks": self.event_acks,
            "heartbeats": self.heartbeats,
            "commits": self.commits,
            "attached": self.ws is not None,
            "closed": self.closed,
        }


class OmniStandin:
    def __init__(self, cfg: StandinConfig) -> None:
        self.cfg = cfg
        self.sessions: dict[str, StandinSession] = {}
        self.refused = 0
        self.opened = 0

    # --- wire helpers --------------------------------------------------------------------------------------
    async def _send(self, s: StandinSession, payload: dict[str, Any], *, journal: bool = True) -> None:
        """Journal (with its ``server_event_seq``) and send to the attached socket, if any."""
        if journal:
            s.seq += 1
            payload = {**payload, "server_event_seq": s.seq}
            s.journal.append(payload)
            del s.journal[:-2000]
        ws = s.ws
        if ws is not None and not ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(json.dumps(payload))

    def _session_object(self, s: StandinSession) -> dict[str, Any]:
        cfg = s.config
        return {
            "object": "realtime.session",
            "type": "realtime",
            "id": s.id,
            "session_id": s.id,
            "model": cfg.get("model"),
            "input_audio_format": s.input_format,
            "output_audio_format": "pcm16",
            "modalities": cfg.get("modalities") or ["audio", "text"],
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": s.input_rate},
                    "sample_rate_hz": s.input_rate,
                },
                "output": {"format": {"type": "audio/pcm", "rate": self.cfg.output_rate}},
            },
            "turn_detection": cfg.get("turn_detection"),
            "capabilities": {
                "supports_model_native_turn_policy": self.cfg.turns == "model",
                "supports_barge_in": self.cfg.supports_barge_in,
                "supports_playback_ack": True,
                "supports_session_resume": True,
                "supports_rollback_to_checkpoint": False,
                "session_admission_mode": "engine_managed",
            },
        }

    # --- HTTP ----------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/realtime", self._ws)
        app.router.add_get("/v1/duplex", self._ws)
        app.router.add_get("/standin/state", self._state)
        app.router.add_post("/standin/speak", self._speak)
        app.router.add_post("/standin/drop", self._drop)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "opened": self.opened,
                "refused": self.refused,
                "live": sum(1 for s in self.sessions.values() if not s.closed),
                "sessions": [s.public() for s in self.sessions.values()],
            }
        )

    async def _speak(self, request: web.Request) -> web.Response:
        wanted = request.query.get("session")
        spoke = []
        for s in self.sessions.values():
            if not s.closed and (wanted is None or s.id == wanted) and not s.generating:
                self._start_response(s)
                spoke.append(s.id)
        return web.json_response({"spoke": spoke})

    async def _drop(self, request: web.Request) -> web.Response:
        dropped = []
        for s in self.sessions.values():
            ws, s.ws = s.ws, None
            if ws is not None and not s.closed:
                s.detached_at = time.monotonic()
                dropped.append(s.id)
                await ws.close(code=1011, message=b"standin drop")
        return web.json_response({"dropped": dropped})

    # --- the duplex socket ---------------------------------------------------------------------------------
    async def _ws(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/v1/realtime" and request.query.get("duplex", "1").lower() in (
            "0",
            "false",
            "no",
        ):
            return web.Response(status=400, text="the stand-in serves only the duplex lane")
        ws = web.WebSocketResponse(max_msg_size=64 << 20)
        await ws.prepare(request)
        session: StandinSession | None = None
        try:
            first = await ws.receive(timeout=10.0)
            if first.type is not WSMsgType.TEXT:
                return ws
            try:
                msg = json.loads(first.data)
            except json.JSONDecodeError:
                await ws.send_str(json.dumps(error_payload("invalid_json", "Invalid JSON in session.update")))
                await ws.close()
                return ws
            if not isinstance(msg, dict):
                await ws.send_str(
                    json.dumps(error_payload("bad_event", "Realtime event must be a JSON object"))
                )
                await ws.close()
                return ws
            kind = msg.get("type")
            if kind == "session.resume":
                session = await self._resume(ws, msg)
            elif kind == "session.update":
                session = await self._open(ws, msg)
            else:
                await ws.send_str(json.dumps(error_payload("bad_event", "send session.update first")))
            if session is None:
                await ws.close()
                return ws
            async for m in ws:
                if m.type is not WSMsgType.TEXT:
                    continue
                if session.ws is not ws:
                    break  # replaced or dropped
                try:
                    cmd = json.loads(m.data)
                except json.JSONDecodeError:
                    await ws.send_str(json.dumps(error_payload("invalid_json", "Invalid JSON event")))
                    continue
                refused = refusal(cmd)
                if refused is not None:
                    await ws.send_str(json.dumps(error_payload(*refused)))
                    continue
                await self._command(session, cmd)
                if session.closed:
                    break
        except TimeoutError:
            pass
        finally:
            if session is not None and session.ws is ws:
                session.ws = None
                session.detached_at = time.monotonic()
        return ws

    async def _open(self, ws: web.WebSocketResponse, msg: dict[str, Any]) -> StandinSession | None:
        live = sum(1 for s in self.sessions.values() if not s.closed)
        if live >= self.cfg.max_sessions:
            self.refused += 1
            payload = error_payload(
                "resource_exhausted",
                f"duplex_session_capacity_exhausted: limit={self.cfg.max_sessions}",
                error_type="rate_limit_error",
            )
            await ws.send_str(json.dumps(payload))
            return None
        raw_cfg = msg.get("session")
        cfg: dict[str, Any] = raw_cfg if isinstance(raw_cfg, dict) else {}
        s = StandinSession(id="duplex_" + secrets.token_hex(8), token=secrets.token_urlsafe(24), config=cfg)
        s.input_format = str(cfg.get("input_audio_format") or "pcm16")
        s.input_rate = int(cfg.get("sample_rate_hz") or 16_000)
        s.ws = ws
        self.sessions[s.id] = s
        self.opened += 1
        session_obj = self._session_object(s)
        created = {
            "type": "session.created",
            "event_id": _event_id(),
            "session": session_obj,
            "attachment_generation": s.generation,
            "resume_token": s.token,
        }
        await self._send(s, created, journal=False)
        await self._send(s, {"type": "session.updated", "event_id": _event_id(), "session": session_obj})
        return s

    async def _resume(self, ws: web.WebSocketResponse, msg: dict[str, Any]) -> StandinSession | None:
        sid, token, last = (
            msg.get("session_id"),
            msg.get("resume_token"),
            msg.get("last_received_server_event_seq", 0),
        )
        if (
            not isinstance(sid, str)
            or not sid
            or not isinstance(token, str)
            or not token
            or not isinstance(last, int)
            or isinstance(last, bool)
            or last < 0
        ):
            await ws.send_str(
                json.dumps(
                    error_payload(
                        "invalid_session_resume",
                        "session.resume requires session_id, resume_token, and a non-negative event sequence",
                    )
                )
            )
            return None
        s = self.sessions.get(sid)
        if s is None or s.closed:
            await ws.send_str(
                json.dumps(
                    error_payload("session_resume_expired", f"Unknown or expired duplex session: {sid}")
                )
            )
            return None
        if token != s.token:
            await ws.send_str(
                json.dumps(error_payload("invalid_resume_token", "Invalid duplex session resume token"))
            )
            return None
        old, s.ws = s.ws, ws
        if old is not None and not old.closed:
            await old.send_str(
                json.dumps({"type": "session.replaced", "event_id": _event_id(), "session_id": s.id})
            )
            await old.close()
        s.generation += 1
        s.token = secrets.token_urlsafe(24)
        s.detached_at = None
        s.resumes += 1
        resumed = {
            "type": "session.resumed",
            "event_id": _event_id(),
            "session_id": s.id,
            "session": self._session_object(s),
            "attachment_generation": s.generation,
            "resume_token": s.token,
        }
        await ws.send_str(json.dumps(resumed))
        for entry in [e for e in s.journal if e["server_event_seq"] > last]:
            await ws.send_str(json.dumps(entry))
        return s

    # --- commands ------------------------------------------------------------------------------------------
    async def _command(self, s: StandinSession, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "input_audio_buffer.append":
            await self._append(s, msg)
        elif kind == "session.event_ack":
            s.event_acks += 1
        elif kind == "playback.ack":
            s.acks.append(
                {
                    "response_id": msg.get("response_id"),
                    "played_ms": msg.get("played_ms"),
                    "committed_ms": msg.get("committed_ms"),
                    "epoch": s.epoch,
                }
            )
        elif kind in ("barge_in", "response.cancel"):
            if kind == "barge_in" and not self.cfg.supports_barge_in:
                await self._send(s, error_payload("bad_event", "this model does not take client barge_in"))
                return
            await self._cancel(s, "barge_in" if kind == "barge_in" else "client_cancelled")
        elif kind == "input_audio_buffer.commit":
            s.commits += 1
            if self.cfg.turns == "commit" and not s.generating:
                await self._turn_end(s)
        elif kind == "session.heartbeat":
            s.heartbeats += 1
            await self._send(
                s, {"type": "session.heartbeat_ack", "event_id": _event_id(), "session_id": s.id}
            )
        elif kind == "session.close":
            await self._close(s, str(msg.get("reason") or "client_close"))
        else:
            pass  # a command the wheel takes (refusal() let it through) that the stand-in's model ignores

    async def _append(self, s: StandinSession, msg: dict[str, Any]) -> None:
        raw = base64.b64decode(msg.get("audio") or "")
        fmt = msg.get("format") or s.input_format
        rate = int(msg.get("sample_rate_hz") or s.input_rate)
        x = (
            np.frombuffer(raw, dtype="<f4")
            if fmt == "pcm_f32le"
            else np.frombuffer(raw, dtype="<i2") / 32768.0
        )
        s.appends += 1
        s.input_format, s.input_rate = str(fmt), rate
        if self.cfg.echo:
            await self._echo(s, x, rate)
            return
        frame = rate // 50
        for i in range(0, x.shape[0] - frame + 1, frame):
            rms = float(np.sqrt(np.mean(np.square(x[i : i + frame], dtype=np.float64))))
            at = round(s.received_ms)
            s.received_ms += 20.0
            s.peak_rms = max(s.peak_rms, rms)
            speech = rms > self.cfg.speech_rms
            if s.generating and s.sent_ms > 0:
                s.overlap_ms = s.overlap_ms + 20 if speech else 0
                if self.cfg.overlap_barge_in_ms and s.overlap_ms >= self.cfg.overlap_barge_in_ms:
                    s.overlap_ms = 0
                    await self._cancel(s, "overlap_barge_in")
                continue
            if speech:
                if s.voiced_ms == 0:
                    s.speech_start_ms = at
                    await self._send(
                        s,
                        {
                            "type": "input_audio_buffer.speech_started",
                            "event_id": _event_id(),
                            "audio_start_ms": at,
                            "item_id": None,
                        },
                    )
                s.voiced_ms += 20
                s.quiet_ms = 0
            elif s.voiced_ms:
                s.quiet_ms += 20
                if s.quiet_ms >= self.cfg.silence_ms:
                    heard = s.voiced_ms
                    s.voiced_ms = s.quiet_ms = 0
                    await self._send(
                        s,
                        {
                            "type": "input_audio_buffer.speech_stopped",
                            "event_id": _event_id(),
                            "audio_end_ms": at,
                            "item_id": None,
                        },
                    )
                    if self.cfg.turns == "model":
                        await self._turn_end(s, heard)
        if x.shape[0] % frame:
            s.received_ms += (x.shape[0] % frame) * 1000 / rate

    async def _echo(self, s: StandinSession, x: np.ndarray, rate: int) -> None:
        s.received_ms += x.shape[0] * 1000 / rate
        if s.response_id is None:
            s.response_id = "resp_" + secrets.token_hex(8)
            s.responses += 1
            await self._send(
                s,
                {
                    "type": "response.created",
                    "event_id": _event_id(),
                    "response": {"id": s.response_id, "object": "realtime.response", "status": "in_progress"},
                    "response_id": s.response_id,
                },
            )
        out_n = x.shape[0] * self.cfg.output_rate // rate
        y = np.interp(np.arange(out_n) * rate / self.cfg.output_rate, np.arange(x.shape[0]), x)
        pcm = np.clip(np.rint(y * 32768.0), -32768, 32767).astype("<i2")
        await self._send(
            s,
            {
                "type": "response.output_audio.delta",
                "event_id": _event_id(),
                "response_id": s.response_id,
                "item_id": None,
                "output_index": 0,
                "content_index": 0,
                "delta": base64.b64encode(pcm.tobytes()).decode(),
                "format": "pcm16",
                "sample_rate_hz": self.cfg.output_rate,
                "metadata": {"session_id": s.id, "epoch": s.epoch},
            },
        )

    async def _turn_end(self, s: StandinSession, heard_ms: int | None = None) -> None:
        item = "item_" + secrets.token_hex(8)
        text = f"heard {heard_ms} ms" if heard_ms is not None else "heard a committed turn"
        await self._send(
            s,
            {
                "type": "conversation.item.input_audio_transcription.completed",
                "event_id": _event_id(),
                "item_id": item,
                "content_index": 0,
                "transcript": text,
            },
        )
        self._start_response(s)

    # --- replies -------------------------------------------------------------------------------------------
    def _start_response(self, s: StandinSession) -> None:
        if s.generating:
            return
        s.generating = True
        s.sent_ms = 0.0
        s.responses += 1
        s.response_id = "resp_" + secrets.token_hex(8)
        s.response_task = asyncio.get_running_loop().create_task(self._respond(s, s.response_id, s.epoch))

    async def _respond(self, s: StandinSession, rid: str, epoch: int) -> None:
        cfg = self.cfg
        item = "item_" + secrets.token_hex(8)
        await self._send(
            s,
            {
                "type": "response.created",
                "event_id": _event_id(),
                "response": {
                    "id": rid,
                    "object": "realtime.response",
                    "status": "in_progress",
                    "status_details": None,
                    "output": [],
                    "modalities": ["audio", "text"],
                    "metadata": {
                        "duplex_event": {"type": "response.created", "response_id": rid, "epoch": epoch}
                    },
                },
                "response_id": rid,
            },
        )
        unit = max(1, cfg.output_rate * cfg.unit_ms // 1000)
        total = cfg.output_rate * cfg.reply_ms // 1000
        t0 = time.monotonic()
        n = 0
        k = 0
        while n < total:
            if s.closed or s.epoch != epoch or s.response_id != rid:
                return
            m = min(unit, total - n)
            t = (np.arange(n, n + m) / cfg.output_rate).astype(np.float64)
            pcm = (9000 * np.sin(2 * math.pi * cfg.tone_hz * t)).astype("<i2")
            n += m
            s.sent_ms = n * 1000 / cfg.output_rate
            await self._send(
                s,
                {
                    "type": "response.output_audio.delta",
                    "event_id": _event_id(),
                    "response_id": rid,
                    "item_id": item,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": base64.b64encode(pcm.tobytes()).decode(),
                    "format": "pcm16",
                    "sample_rate_hz": cfg.output_rate,
                    "metadata": {"session_id": s.id, "epoch": epoch, "model_speak": True},
                },
            )
            await self._send(
                s,
                {
                    "type": "response.output_audio_transcript.delta",
                    "event_id": _event_id(),
                    "response_id": rid,
                    "item_id": item,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": f"w{k} ",
                },
            )
            k += 1
            await asyncio.sleep(max(0.0, t0 + n / cfg.output_rate - time.monotonic()))
        transcript = "".join(f"w{i} " for i in range(k))
        s.generating = False
        await self._send(
            s,
            {
                "type": "response.output_audio.done",
                "event_id": _event_id(),
                "response_id": rid,
                "item_id": item,
                "output_index": 0,
                "content_index": 0,
            },
        )
        await self._send(
            s,
            {
                "type": "response.output_audio_transcript.done",
                "event_id": _event_id(),
                "response_id": rid,
                "item_id": item,
                "output_index": 0,
                "content_index": 0,
                "transcript": transcript,
            },
        )
        await self._send(
            s, self._response_done(rid, "completed", {"type": "completed", "reason": "stop"}, {})
        )

    @staticmethod
    def _response_done(
        rid: str, status: str, details: dict[str, Any], metadata: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "type": "response.done",
            "event_id": _event_id(),
            "response": {
                "id": rid,
                "object": "realtime.response",
                "status": status,
                "status_details": details,
                "output": [],
                "metadata": metadata,
            },
            "response_id": rid,
        }

    async def _cancel(self, s: StandinSession, reason: str) -> None:
        """The runner's ``_cancel_active_response``: commit the played part, bump the epoch, ``audio.cancelled``."""
        rid = s.response_id
        committed = next((a["committed_ms"] for a in reversed(s.acks) if a["response_id"] == rid), 0) or 0
        old = s.epoch
        if rid is None:
            return
        if not s.generating:
            # Generation finished before the barge-in: only the queued playback is cleared.
            if s.sent_ms > committed:
                s.epoch += 1
                s.barge_ins.append(
                    {"response_id": rid, "reason": reason, "committed_ms": committed, "epoch": s.epoch}
                )
                s.response_id = None
                await self._send(
                    s, {"type": "output_audio_buffer.cleared", "event_id": _event_id(), "response_id": rid}
                )
            return
        s.epoch += 1
        s.generating = False
        s.response_id = None
        cancelled = {
            "type": "audio.cancelled",
            "session_id": s.id,
            "response_id": rid,
            "reason": reason,
            "cancelled_epoch": old,
            "epoch": s.epoch,
            "committed_ms": committed,
            "playback": {"sent_ms": round(s.sent_ms), "committed_ms": committed},
        }
        s.barge_ins.append(
            {"response_id": rid, "reason": reason, "committed_ms": committed, "epoch": s.epoch}
        )
        await self._send(
            s,
            {
                "type": "response.output_audio.done",
                "event_id": _event_id(),
                "response_id": rid,
                "item_id": None,
                "output_index": 0,
                "content_index": 0,
            },
        )
        await self._send(
            s, self._response_done(rid, "cancelled", {"type": "cancelled", "reason": reason}, cancelled)
        )

    async def _close(self, s: StandinSession, reason: str) -> None:
        if s.closed:
            return
        await self._send(
            s,
            {
                "type": "session.closed",
                "event_id": _event_id(),
                "session_id": s.id,
                "reason": reason,
                "event": {"type": "session.closed", "reason": reason},
            },
        )
        s.closed = True
        s.generating = False
        if s.ws is not None:
            await s.ws.close()

    async def reap(self) -> None:
        """Sessions detached past the grace period expire (the lease's ``disconnect_grace_s``)."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                if (
                    not s.closed
                    and s.ws is None
                    and s.detached_at is not None
                    and now - s.detached_at > self.cfg.grace_s
                ):
                    s.closed = True
                    s.generating = False


async def serve(cfg: StandinConfig, host: str, port: int) -> None:
    standin = OmniStandin(cfg)
    runner = web.AppRunner(standin.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    # Like the engine after loading (engine_bridge/engine.py): what start-up allocated is frozen out of the
    # collector's walks, so a full collection does not pause the stand-in's echo for tens of milliseconds
    # in the middle of benchmarks/omni_bridge.py's latency figure.
    gc.collect()
    gc.freeze()
    log.info("omni stand-in on ws://%s:%d/v1/realtime?duplex=1 (%s)", host, port, cfg)
    print(f"omni-standin ready on {host}:{port}", flush=True)
    await standin.reap()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="omni_standin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8091)
    defaults = StandinConfig()
    for f in StandinConfig.__dataclass_fields__.values():
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"), default=value)
        else:
            ap.add_argument(flag, type=type(value), default=value)
    args = ap.parse_args(argv)
    cfg = StandinConfig(**{k: getattr(args, k) for k in StandinConfig.__dataclass_fields__})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvloop where it is installed, as uvicorn (which ``vllm-omni serve`` runs on) picks it.
    try:
        import uvloop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    else:
        loop_factory = uvloop.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(cfg, args.host, args.port))


if __name__ == "__main__":
    main()
