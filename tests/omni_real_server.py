"""vLLM-Omni 0.30's own duplex WebSocket server, on CPU, with a scripted engine below it (tests only).

Run with the ``.venv-omni`` interpreter (``make omni-env``; docs/omni-models.md, "Against vLLM-Omni's own server
code"), not this project's: it imports the vllm-omni 0.30.0 wheel and the vLLM 0.30 it pins.

What is the wheel's code, unchanged: the WebSocket handler ``OmniDuplexSessionHandler``
(``vllm_omni/entrypoints/duplex/serving.py``: handshake, ``session.resume``, resume tokens, the replay journal,
``session.event_ack``, takeover, detach on disconnect), the client-event parsing and validation
(``RealtimeEnvelope.translate`` in ``entrypoints/duplex/realtime_input.py``: an unknown event type, a missing or
ill-typed field is refused there with the wheel's own ``error``), the session-config normalization
(``DuplexOmni._resolve_session_config`` → ``DuplexSessionConfig.from_realtime``), the session handle and its event
routing (``DuplexOmni`` / ``DuplexSessionHandle`` in ``entrypoints/duplex_omni.py``), the per-session engine state
and its lease (``DuplexEngineSession`` with ``DuplexLeaseState``: generations, compare-and-set resume, disconnect
grace), and the event emission (``RealtimeProjectionState`` / ``project_internal_event`` in
``engine/duplex/realtime_events.py``, which turns the runner's internal events, ``audio.cancelled`` included, into
the typed wire events and their ``to_realtime()`` rendering).

What is replaced: ``DuplexOmniEngine`` (the object ``DuplexOmni`` calls: ``open_session_async``,
``resume_session_async``, ``touch_session_async``, ``close_session_async``, ``submit_command_async``) by
:class:`ScriptedEngine`, which does what the wheel's ``DuplexSessionManager`` does at those calls (admission against
``max_sessions`` with ``resource_exhausted``, the lease calls, ``session.heartbeat_ack``, ``session.closed``,
``session.expired`` after the disconnect grace) and in place of the model emits the internal events a session
runner emits: an energy gate decides the caller's turn for a model that owns turn-taking (``input_audio_buffer.
commit`` does for one that does not), the voice is a tone at the model's output rate in 80 ms units with one word
of transcript each, and ``barge_in`` / ``response.cancel`` end it as ``audio.cancelled`` with the last acked
position. The wheel's ``vllm_omni.engine.duplex_omni_engine`` and ``vllm_omni.entrypoints.async_omni`` modules are
the engine process and its stage plumbing (model loading, schedulers, the vLLM engine cores); they are not
imported: two placeholder modules stand in for them so that ``duplex_omni`` imports without them.

A TCP relay sits in front of the server, so ``POST /fake/drop`` can cut every bridge socket without a close
handshake (a dropped connection, the way a network fails), which is what the resume path is for.

Control endpoints (on the server's own port, past the relay): ``GET /fake/state`` (per session: what the engine received, as the wheel
parsed it), ``POST /fake/drop``, ``POST /fake/speak`` (model-initiated speech). ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import math
import sys
import time
import types
import uuid
from typing import Any

import numpy as np

# --- the engine process's modules, not imported (see the module docstring) -------------------------------------


def _placeholder_modules() -> None:
    engine_mod = types.ModuleType("vllm_omni.engine.duplex_omni_engine")

    class DuplexOmniEngine:  # only a name in duplex_omni's annotations; ScriptedEngine takes its place
        pass

    engine_mod.DuplexOmniEngine = DuplexOmniEngine  # type: ignore[attr-defined]
    async_mod = types.ModuleType("vllm_omni.entrypoints.async_omni")

    class AsyncOmni:  # DuplexOmni's base: its __init__ starts the stage processes, which is what is replaced
        def _final_output_handler(self) -> None:
            """The base starts its engine-output task here; ScriptedEngine delivers events directly."""

    async_mod.AsyncOmni = AsyncOmni  # type: ignore[attr-defined]
    sys.modules[engine_mod.__name__] = engine_mod
    sys.modules[async_mod.__name__] = async_mod


_placeholder_modules()

from fastapi import FastAPI, WebSocket  # noqa: E402  (after the placeholders)
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402
from vllm_omni.config.stage_config import DuplexSessionRuntimeConfig  # noqa: E402
from vllm_omni.engine.duplex import commands as C  # noqa: E402
from vllm_omni.engine.duplex.config import DuplexCapabilities, DuplexSessionConfig  # noqa: E402
from vllm_omni.engine.duplex.events import SessionHeartbeatAck, error_event  # noqa: E402
from vllm_omni.engine.duplex.messages import (  # noqa: E402
    DuplexControlResultMessage,
    DuplexSessionError,
    DuplexSessionEventMessage,
)
from vllm_omni.engine.duplex.plugin import (  # noqa: E402
    DuplexModelPlugin,
    DuplexRuntimeConfigError,
    load_duplex_plugin,
)
from vllm_omni.engine.duplex.realtime_events import RealtimeProjectionState, project_internal_event  # noqa: E402
from vllm_omni.engine.duplex.session.engine_session import DuplexEngineSession  # noqa: E402
from vllm_omni.engine.duplex.session.lease import DuplexLeaseActivity, DuplexLeaseConfig, DuplexLeaseState  # noqa: E402
from vllm_omni.entrypoints.duplex.audio_encoding import encode_audio  # noqa: E402
from vllm_omni.entrypoints.duplex.serving import OmniDuplexSessionHandler  # noqa: E402
from vllm_omni.entrypoints.duplex_omni import DuplexOmni  # noqa: E402

#: Per served model: the wheel's duplex plugin (its ``pipeline.py`` ``duplex_plugin``), whose ``capabilities()`` and
#: ``validate_client_extra_body()`` run here as they do in the engine, the output rate and the deploy file's
#: ``runtime.max_sessions``. PersonaPlex declares no duplex plugin in 0.30.0 (its pipeline has none, and
#: ``personaplex/duplex/plugin.py`` does not import: it asks ``engine.duplex.messages`` for ``DuplexFence``), so its
#: capabilities are written out from this project's preset instead.
_MODELS_PKG = "vllm_omni.model_executor.models"
MODELS: dict[str, dict[str, Any]] = {
    "openbmb/MiniCPM-o-4_5": {
        "plugin": f"{_MODELS_PKG}.minicpmo_4_5.duplex.plugin.MiniCPMO45DuplexPlugin",
        "output_rate": 24_000,
        "max_sessions": 4,
    },
    "Qwen/Qwen3-Omni-30B-A3B-Instruct": {
        "plugin": f"{_MODELS_PKG}.qwen3_omni.duplex.plugin.Qwen3OmniDuplexPlugin",
        "output_rate": 24_000,
        "max_sessions": 4,
    },
    "nvidia/personaplex-7b-v1": {
        "plugin": None,
        "native_turns": True,
        "barge_in": False,
        "output_rate": 24_000,
        "max_sessions": 2,
    },
    "nvidia/NVIDIA-NemotronLabs-VoiceChat-11B": {
        "plugin": f"{_MODELS_PKG}.nemotron_voicechat.duplex.plugin.NemotronVoiceChatDuplexPlugin",
        "output_rate": 22_050,
        "max_sessions": 1,
    },
}


def load_plugin(model: dict[str, Any]) -> DuplexModelPlugin | None:
    if model.get("plugin") is None:
        return None
    if "loaded" not in model:
        model["loaded"] = load_duplex_plugin(model["plugin"], encode_audio)
    return model["loaded"]  # type: ignore[no-any-return]


@dataclasses.dataclass
class Script:
    reply_ms: int = 1200
    unit_ms: int = 80
    tone_hz: float = 660.0
    silence_ms: int = 400
    speech_rms: float = 0.02


@dataclasses.dataclass
class FakeSession:
    """The scripted model's side of one session, next to the wheel's ``DuplexEngineSession``."""

    engine_session: DuplexEngineSession
    projector: RealtimeProjectionState
    model: dict[str, Any]
    closed: bool = False
    # what the tests read back: the commands as the wheel's envelope parsed them
    appends: int = 0
    formats: set[str] = dataclasses.field(default_factory=set)
    rates: set[int] = dataclasses.field(default_factory=set)
    durations: set[int] = dataclasses.field(default_factory=set)
    last_audio_end_ms: int | None = None
    received_ms: float = 0.0
    commits: int = 0
    acks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    barge_ins: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cancels: int = 0
    heartbeats: int = 0
    resumes: int = 0
    detaches: int = 0
    close_reason: str | None = None
    # the energy gate and the reply
    voiced_ms: int = 0
    quiet_ms: int = 0
    response_id: str | None = None
    generating: bool = False
    sent_ms: float = 0.0
    task: asyncio.Task[None] | None = None

    def public(self) -> dict[str, Any]:
        lease = self.engine_session.lease
        return {
            "id": self.engine_session.session_id,
            "model": self.engine_session.config.model,
            "appends": self.appends,
            "formats": sorted(self.formats),
            "rates": sorted(self.rates),
            "durations": sorted(self.durations),
            "last_audio_end_ms": self.last_audio_end_ms,
            "received_ms": round(self.received_ms),
            "commits": self.commits,
            "acks": self.acks[-50:],
            "barge_ins": self.barge_ins,
            "cancels": self.cancels,
            "heartbeats": self.heartbeats,
            "resumes": self.resumes,
            "detaches": self.detaches,
            "lease_generation": lease.generation,
            "detached": lease.detached_at is not None,
            "epoch": self.engine_session.epoch,
            "closed": self.closed,
            "close_reason": self.close_reason,
        }


class ScriptedEngine:
    """In place of ``DuplexOmniEngine`` (see the module docstring); one asyncio loop, the server's."""

    def __init__(self, model: str, runtime: DuplexSessionRuntimeConfig, script: Script) -> None:
        self.model = model
        self.duplex_session_config = runtime
        self.script = script
        self.omni: DuplexOmni | None = None
        self.sessions: dict[str, FakeSession] = {}
        self.refused = 0
        self.errors: list[dict[str, Any]] = []

    # --- plumbing ------------------------------------------------------------------------------------------
    @property
    def duplex_capabilities(self) -> DuplexCapabilities:
        return self._capabilities(MODELS[self.model])

    def _capabilities(self, model: dict[str, Any]) -> DuplexCapabilities:
        plugin = load_plugin(model)
        if plugin is not None:
            return plugin.capabilities(max_sessions=int(model["max_sessions"]))
        return DuplexCapabilities(
            supports_model_native_turn_policy=bool(model["native_turns"]),
            supports_barge_in=bool(model["barge_in"]),
            supports_session_resume=True,
            supports_session_lease=True,
        )

    def is_alive(self) -> bool:
        return True

    def _emit(self, s: FakeSession, internal: dict[str, Any]) -> None:
        """An internal runner event, projected by the wheel onto typed wire events, routed like the engine's."""
        assert self.omni is not None
        for event in project_internal_event(s.projector, internal):
            if event.type == "error":
                self.errors.append(event.to_realtime())
            self.omni._route_engine_message(
                DuplexSessionEventMessage(session_id=s.engine_session.session_id, event=event)
            )

    def _emit_typed(self, s: FakeSession, event: Any) -> None:
        assert self.omni is not None
        self.omni._route_engine_message(
            DuplexSessionEventMessage(session_id=s.engine_session.session_id, event=event)
        )

    def _result(self, operation: str, session_id: str, s: FakeSession | None) -> DuplexControlResultMessage:
        es = s.engine_session if s is not None else None
        return DuplexControlResultMessage(
            control_id=uuid.uuid4().hex,
            operation=operation,
            session_id=session_id,
            ok=True,
            lease_generation=es.lease_generation if es is not None else None,
            capabilities=es.capabilities if es is not None else None,
            public_session=es.as_public_dict() if es is not None else None,
        )

    def _require(self, session_id: str) -> FakeSession:
        s = self.sessions.get(session_id)
        if s is None or s.closed:
            raise DuplexSessionError(f"unknown duplex session: {session_id}", code="unknown_session")
        return s

    # --- the control surface DuplexOmni calls --------------------------------------------------------------
    async def open_session_async(
        self, session_id: str, session_config: DuplexSessionConfig, *, timeout: float | None = None
    ) -> DuplexControlResultMessage:
        model = MODELS.get(str(session_config.model or self.model), MODELS[self.model])
        limit = min(int(self.duplex_session_config.max_sessions), int(model["max_sessions"]))
        if sum(1 for s in self.sessions.values() if not s.closed) >= limit:
            self.refused += 1
            raise DuplexSessionError(
                f"duplex_session_capacity_exhausted: limit={limit}", code="resource_exhausted", retryable=True
            )
        plugin = load_plugin(model)
        if plugin is not None:
            try:  # the manager's open: the plugin refuses client keys it owns
                plugin.validate_client_extra_body(session_config.extra_body)
            except DuplexRuntimeConfigError as exc:
                raise DuplexSessionError(str(exc), code=exc.code) from exc
        rt = self.duplex_session_config
        es = DuplexEngineSession(
            session_id=session_id,
            config=session_config,
            capabilities=self._capabilities(model),
            lease=DuplexLeaseState(
                config=DuplexLeaseConfig(idle_ttl_s=rt.idle_ttl_s, disconnect_grace_s=rt.disconnect_grace_s),
                generation=0,
                last_activity=time.monotonic(),
            ),
        )
        default_payload = session_config.extra_body.get("realtime_session_payload")
        projector = RealtimeProjectionState(
            session_id=session_id,
            model=session_config.model,
            default_payload=default_payload if isinstance(default_payload, dict) else None,
            initial_session_update=True,
        )
        s = FakeSession(engine_session=es, projector=projector, model=model)
        self.sessions[session_id] = s
        result = self._result("open", session_id, s)
        # The runner's start(): its first event, after the open's result (DuplexOmni registered the handle first).
        asyncio.get_running_loop().call_soon(
            lambda: self._emit(s, {"type": "session.created", "session": es.as_public_dict()})
        )
        return result

    async def resume_session_async(
        self,
        session_id: str,
        *,
        expected_lease_generation: int,
        control_id: str | None = None,
        timeout: float | None = None,
    ) -> DuplexControlResultMessage:
        s = self._require(session_id)
        try:
            s.engine_session.resume_lease(
                expected_lease_generation=expected_lease_generation, control_id=control_id
            )
        except ValueError as exc:
            raise DuplexSessionError(str(exc), code="session_resume_conflict") from exc
        s.resumes += 1
        return self._result("resume", session_id, s)

    async def touch_session_async(
        self,
        session_id: str,
        *,
        activity: str,
        expected_lease_generation: int | None = None,
        timeout: float | None = None,
    ) -> DuplexControlResultMessage:
        s = self._require(session_id)
        act = DuplexLeaseActivity(activity)
        if act is DuplexLeaseActivity.DETACH:
            if (
                expected_lease_generation is not None
                and expected_lease_generation != s.engine_session.lease_generation
            ):
                raise DuplexSessionError("duplex lease generation mismatch", code="session_resume_conflict")
            s.engine_session.detach_lease()
            s.detaches += 1
        else:
            s.engine_session.touch_lease(act)
        return self._result("touch", session_id, s)

    async def close_session_async(
        self, session_id: str, *, reason: str = "client_close", timeout: float | None = None
    ) -> DuplexControlResultMessage:
        s = self.sessions.get(session_id)
        if s is not None and not s.closed:
            self._close(s, reason)
        return self._result("close", session_id, None)

    async def submit_command_async(self, session_id: str, command: C.DuplexCommand) -> None:
        s = self._require(session_id)
        es = s.engine_session
        if isinstance(command, C.AppendAudio):
            es.touch_lease(DuplexLeaseActivity.APPEND)
            self._append(s, command)
        elif isinstance(command, C.Commit):
            s.commits += 1
            # A commit answers only when the client asks (create_response) or the session auto-responds.
            asks = (
                command.create_response is True
                or s.engine_session.config.extra_body.get("auto_response") is True
            )
            if (
                not s.engine_session.capabilities.supports_model_native_turn_policy
                and not s.generating
                and asks
            ):
                self._turn_end(s, None)
        elif isinstance(command, C.AckPlayback):
            es.touch_lease(DuplexLeaseActivity.PLAYBACK_ACK)
            s.acks.append(
                {
                    "played_ms": command.played_ms,
                    "committed_ms": command.committed_ms,
                    "response_id": command.response_id,
                }
            )
        elif isinstance(command, C.BargeIn):
            if not es.capabilities.supports_barge_in:
                # What the runner answers a model whose plugin reports supports_barge_in=False.
                self._emit_typed(s, error_event("unsupported_barge_in", "this model does not take barge_in"))
                self.errors.append({"code": "unsupported_barge_in"})
                return
            self._cancel(s, "barge_in")
        elif isinstance(command, C.CancelResponse):
            s.cancels += 1
            if command.response_id in (None, s.response_id):
                self._cancel(s, "client_cancelled")
        elif isinstance(command, C.Heartbeat):
            es.touch_lease(DuplexLeaseActivity.HEARTBEAT)  # the runner's _on_heartbeat
            s.heartbeats += 1
            self._emit_typed(s, SessionHeartbeatAck())
        elif isinstance(command, C.CloseSession):
            self._close(s, command.reason or "client_close")
        else:
            self.errors.append({"code": "unexpected_command", "type": type(command).__name__})

    # --- the scripted model --------------------------------------------------------------------------------
    def _append(self, s: FakeSession, cmd: C.AppendAudio) -> None:
        fmt = str(cmd.format)
        rate = int(cmd.sample_rate_hz or 16_000)
        s.appends += 1
        s.formats.add(fmt)
        s.rates.add(rate)
        if cmd.duration_ms is not None:
            s.durations.add(int(cmd.duration_ms))
        s.last_audio_end_ms = cmd.audio_end_ms
        x = (
            np.frombuffer(cmd.audio, dtype="<f4").astype(np.float64)
            if fmt == "pcm_f32le"
            else np.frombuffer(cmd.audio, dtype="<i2") / 32768.0
        )
        s.received_ms += x.shape[0] * 1000 / rate
        if s.generating:
            return
        frame = rate // 50
        for i in range(0, x.shape[0] - frame + 1, frame):
            rms = float(np.sqrt(np.mean(np.square(x[i : i + frame]))))
            if rms > self.script.speech_rms:
                s.voiced_ms += 20
                s.quiet_ms = 0
            elif s.voiced_ms:
                s.quiet_ms += 20
                if s.quiet_ms >= self.script.silence_ms:
                    heard, s.voiced_ms, s.quiet_ms = s.voiced_ms, 0, 0
                    if s.engine_session.capabilities.supports_model_native_turn_policy:
                        self._turn_end(s, heard)
                        return

    def _turn_end(self, s: FakeSession, heard_ms: int | None) -> None:
        text = f"heard {heard_ms} ms" if heard_ms is not None else "heard a committed turn"
        self._emit(s, {"type": "input.transcribed", "transcript": text})
        self.start_response(s)

    def start_response(self, s: FakeSession) -> None:
        if s.generating or s.closed:
            return
        s.generating = True
        s.sent_ms = 0.0
        s.response_id = "resp_" + uuid.uuid4().hex[:16]
        s.task = asyncio.get_running_loop().create_task(
            self._respond(s, s.response_id, s.engine_session.epoch)
        )

    async def _respond(self, s: FakeSession, rid: str, epoch: int) -> None:
        sid = s.engine_session.session_id
        rate = int(s.model["output_rate"])
        self._emit(s, {"type": "response.created", "response_id": rid, "epoch": epoch})
        unit = rate * self.script.unit_ms // 1000
        total = rate * self.script.reply_ms // 1000
        t0 = time.monotonic()
        n = k = 0
        while n < total:
            if s.closed or s.engine_session.epoch != epoch or s.response_id != rid:
                return
            m = min(unit, total - n)
            t = np.arange(n, n + m) / rate
            pcm = (9000 * np.sin(2 * math.pi * self.script.tone_hz * t)).astype("<i2")
            n += m
            s.sent_ms = n * 1000 / rate
            self._emit(
                s,
                {
                    "type": "response.output_audio.delta",
                    "response_id": rid,
                    "audio": base64.b64encode(pcm.tobytes()).decode("ascii"),
                    "format": "pcm16",
                    "sample_rate_hz": rate,
                    "text": f"w{k} ",
                    "session_id": sid,
                    "epoch": epoch,
                    "model_speak": True,
                    "end_of_turn": n >= total,
                },
            )
            k += 1
            await asyncio.sleep(max(0.0, t0 + n / rate - time.monotonic()))
        s.generating = False

    def _cancel(self, s: FakeSession, reason: str) -> None:
        """The runner's ``_cancel_active_response``: commit the acked part, advance the epoch, ``audio.cancelled``."""
        rid = s.response_id
        if rid is None:
            return
        es = s.engine_session
        committed = next((a["committed_ms"] for a in reversed(s.acks) if a["response_id"] == rid), 0) or 0
        old = es.epoch
        es.epoch += 1
        s.barge_ins.append(
            {"response_id": rid, "reason": reason, "committed_ms": committed, "epoch": es.epoch}
        )
        s.generating = False
        s.response_id = None
        self._emit(
            s,
            {
                "type": "audio.cancelled",
                "session_id": es.session_id,
                "response_id": rid,
                "reason": reason,
                "cancelled_epoch": old,
                "epoch": es.epoch,
                "committed_ms": committed,
                "playback": {"sent_ms": round(s.sent_ms), "committed_ms": committed},
            },
        )

    def _close(self, s: FakeSession, reason: str) -> None:
        if s.closed:
            return
        s.closed = True
        s.close_reason = reason
        s.generating = False
        with contextlib.suppress(RuntimeError):
            s.engine_session.lease.mark_terminal(reason)
        self._emit(s, {"type": "session.closed", "reason": reason})

    async def reap(self) -> None:
        """The manager's reaper: a detached lease past its disconnect grace expires the session."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for s in list(self.sessions.values()):
                if not s.closed and s.engine_session.lease.disconnect_grace_expired(now):
                    self._close(s, "session_expired")


# --- the TCP relay: /fake/drop cuts every connection without a close handshake ----------------------------------


class Relay:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        link = (writer, up_writer)
        self.links.add(link)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            self.links.discard(link)

    def drop(self) -> int:
        n = 0
        for down, up in list(self.links):
            for w in (down, up):
                transport = w.transport
                if transport is not None:
                    transport.abort()
            n += 1
        self.links.clear()
        return n


def build_app(engine: ScriptedEngine, relay: Relay) -> FastAPI:
    omni = object.__new__(DuplexOmni)
    omni.model = engine.model  # type: ignore[attr-defined]
    omni.engine = engine  # type: ignore[assignment]
    omni._handles = {}
    omni._resume_compensations = set()
    omni._resume_replay_backoff_s = (0.5, 5.0)
    engine.omni = omni
    handler = OmniDuplexSessionHandler(duplex_omni=omni)
    app = FastAPI()

    # The routes vllm-omni's API server registers for the duplex lane (``/v1/realtime?duplex=1``, ``/v1/duplex``).
    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket) -> None:
        await handler.handle_realtime_session(websocket)

    @app.websocket("/v1/duplex")
    async def duplex(websocket: WebSocket) -> None:
        await handler.handle_realtime_session(websocket)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/fake/state")
    async def state() -> JSONResponse:
        return JSONResponse(
            {
                "refused": engine.refused,
                "errors": engine.errors,
                "sessions": [s.public() for s in engine.sessions.values()],
            }
        )

    @app.post("/fake/drop")
    async def drop() -> JSONResponse:
        return JSONResponse({"dropped": relay.drop()})

    @app.post("/fake/speak")
    async def speak() -> JSONResponse:
        spoke = []
        for s in engine.sessions.values():
            if not s.closed and not s.generating:
                engine.start_response(s)
                spoke.append(s.engine_session.session_id)
        return JSONResponse({"spoke": spoke})

    return app


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    runtime = DuplexSessionRuntimeConfig(
        max_sessions=args.max_sessions, disconnect_grace_s=args.grace_s, reaper_interval_s=0.25
    )
    engine = ScriptedEngine(args.model, runtime, Script(reply_ms=args.reply_ms, tone_hz=args.tone_hz))
    relay = Relay(args.port + 1)
    config = uvicorn.Config(
        build_app(engine, relay), host="127.0.0.1", port=args.port + 1, log_level="warning", ws="websockets"
    )
    server = uvicorn.Server(config)
    relay_server = await asyncio.start_server(relay.handle, "127.0.0.1", args.port)
    reaper = asyncio.create_task(engine.reap())
    try:
        async with relay_server:
            print(f"omni-real-server ready on 127.0.0.1:{args.port}", flush=True)
            await server.serve()
    finally:
        reaper.cancel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--port", type=int, required=True, help="the relay's port; the server itself listens on port+1"
    )
    ap.add_argument("--model", default="openbmb/MiniCPM-o-4_5", choices=sorted(MODELS))
    ap.add_argument("--max-sessions", type=int, default=4)
    ap.add_argument("--grace-s", type=float, default=30.0)
    ap.add_argument("--reply-ms", type=int, default=1200)
    ap.add_argument("--tone-hz", type=float, default=660.0)
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
