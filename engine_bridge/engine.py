"""The engine process: control server, session manager, audio thread and scheduler thread.

Threads:
* main thread — asyncio: the control server, admission, the idle reaper. It never runs model work, so the control
  channel always answers.
* audio thread — every 10 ms, for each session: read ingress, hand the audio to the adapter (turn-taking and
  barge-in run here, so an interruption is never stuck behind a model step), move the outbox into egress.
* scheduler thread — the single owner of session state: drains each session's mailbox in order, then runs one
  batched model step for every session with work.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import psutil

from engine_bridge import protocol as p
from engine_bridge.adapters import ModelAdapter, make_adapter
from engine_bridge.adapters.base import SessionRefused
from engine_bridge.config import EngineSettings
from engine_bridge.control import Address, ControlServer, ServerConnection
from engine_bridge.doorbell import Doorbell
from engine_bridge.heap import HeapTrimmer
from engine_bridge.ring import NATIVE as RING_NATIVE
from engine_bridge.ring import RingError, RingPair, remove_orphan_segments
from engine_bridge.session import (
    DuplexSession,
    InterruptRequest,
    MuteChange,
    TextAppend,
    TruncateRequest,
)
from engine_bridge.text import TextRefused, TextRequest

log = logging.getLogger("engine_bridge.engine")

#: While reply audio waits in an outbox for room in egress, the audio thread retries this often.
AUDIO_TICK_S: Final = 0.010
#: Otherwise it sleeps on the doorbell: producers ring it after writing caller audio and the scheduler after
#: queueing reply audio, so this timeout is only a safety net (e.g. a client that cannot reach the doorbell).
#: A 10 ms timer here cost a second wake-up per 20 ms frame for nothing (benchmarks/ring_ipc.py).
AUDIO_IDLE_WAIT_S: Final = 0.100
READ_CHUNK_SAMPLES: Final = 16_000  # at most 1 s of caller audio per session per tick


#: The sampling temperatures a session may ask for (0 is greedy).
MAX_TEMPERATURE: Final = 2.0
#: The longest automatic acknowledgement delay a session may ask for (a minute of silence is no acknowledgement).
MAX_ACKNOWLEDGEMENT_MS: Final = 60_000


def _check_settings(
    temperature: float | None, max_output_tokens: int | None, acknowledgement_delay_ms: int | None
) -> str:
    """Why these per-session settings are refused ("" when they are fine)."""
    if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:
        return f"temperature is between 0 and {MAX_TEMPERATURE:g}"
    if max_output_tokens is not None and max_output_tokens < 0:
        return "max_output_tokens is 0 (the engine's reply limit) or more"
    if acknowledgement_delay_ms is not None and not -1 <= acknowledgement_delay_ms <= MAX_ACKNOWLEDGEMENT_MS:
        return f"acknowledgement_delay_ms is -1 (none) or 0 to {MAX_ACKNOWLEDGEMENT_MS}"
    return ""


def _check_append(cmd: p.AppendText) -> str:
    """Why this append is refused ("" when it is fine)."""
    if cmd.max_output_tokens < 0:
        return "max_output_tokens is 0 (the session's limit) or more"
    if cmd.tool_choice is not None and cmd.kind != "respond":
        return "tool_choice is for a reply the append asks for (kind 'respond')"
    if cmd.kind == "tool_call" and cmd.call is None:
        return "a tool_call append carries the call"
    if cmd.kind == "tool_result" and not cmd.call_id:
        return "a tool_result append names the call it answers (call_id)"
    return ""


class AdmissionError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Open:
    session: DuplexSession
    done: concurrent.futures.Future[None]


@dataclass(slots=True)
class _Close:
    session: DuplexSession
    reason: p.CloseReason
    done: concurrent.futures.Future[None]


class SessionManager:
    """Admission against ``max_sessions``, the session table, and per-session leases (one owner connection)."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self.sessions: dict[str, DuplexSession] = {}
        self.rejected = 0
        self.opened = 0
        self.closed = 0

    def admit(self, session: DuplexSession) -> None:
        with self._lock:
            if session.id in self.sessions:
                raise AdmissionError(p.ErrorCode.SESSION_EXISTS, f"session {session.id} is already open")
            if len(self.sessions) >= self.settings.max_sessions:
                self.rejected += 1
                raise AdmissionError(
                    p.ErrorCode.SESSION_LIMIT_REACHED,
                    f"the engine is full ({self.settings.max_sessions} sessions); try again later",
                )
            self.sessions[session.id] = session
            self.opened += 1

    def remove(self, session_id: str) -> DuplexSession | None:
        with self._lock:
            s = self.sessions.pop(session_id, None)
            if s is not None:
                self.closed += 1
            return s

    def get(self, session_id: str) -> DuplexSession | None:
        return self.sessions.get(session_id)

    def snapshot(self) -> list[DuplexSession]:
        with self._lock:
            return list(self.sessions.values())


class Engine:
    def __init__(self, settings: EngineSettings, adapter: ModelAdapter | None = None) -> None:
        self.settings = settings
        self.adapter = adapter or make_adapter(settings)
        self.manager = SessionManager(settings)
        self.state = p.EngineState.STARTING
        self.load_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: ControlServer | None = None
        self._conns: dict[int, ServerConnection] = {}
        self._threads: list[threading.Thread] = []
        self.started_at = time.monotonic()
        self.audio_tick_overruns = 0
        self.doorbell: Doorbell | None = None
        #: Text requests not finished yet, by request id (event loop only); the counters are /health's.
        self.texts: dict[str, TextRequest] = {}
        self.texts_started = 0
        #: Gives the C heap's freed holes back to the system when the scheduler idles (engine_bridge/heap.py).
        self.heap = HeapTrimmer(self.settings.heap_trim_interval_s)
        self.texts_rejected = 0
        # Workers of the adapter (ASR, TTS) wake the scheduler when their results land in a mailbox.
        self.adapter.wake = self._wake
        self.adapter.end_session = self._end_session_threadsafe

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        removed = remove_orphan_segments()
        if removed:
            log.info("removed %d orphaned ring segments at start-up", len(removed))
        self._server = ControlServer(
            Address.parse(self.settings.address), self._handle, on_disconnect=self._on_disconnect
        )
        await self._server.start()
        # The doorbell lives next to the socket; over TCP (another container on the same host) in a private
        # temporary folder, whose path the Hello reply tells the client.
        addr = self._server.address
        bell_dir = (
            Path(addr.path).parent if addr.kind == "unix" else Path(tempfile.mkdtemp(prefix="lko-engine-"))
        )
        # One engine per socket path, so a fixed name: a restarted engine replaces its dead predecessor's FIFO.
        self.doorbell = Doorbell(
            bell_dir / (Path(addr.path).stem + ".bell" if addr.kind == "unix" else "engine.bell")
        )
        log.info(
            "engine %d listening on %s (adapter %s)", os.getpid(), self._server.address, self.adapter.name
        )
        self.state = p.EngineState.LOADING
        loader = threading.Thread(target=self._load, name="engine-loader", daemon=True)
        loader.start()
        self._threads = [
            threading.Thread(target=self._audio_loop, name="engine-audio", daemon=True),
            threading.Thread(target=self._scheduler_loop, name="engine-scheduler", daemon=True),
        ]
        for t in self._threads:
            t.start()
        self._reaper = asyncio.create_task(self._reap_idle())

    @property
    def address(self) -> Address:
        assert self._server is not None
        return self._server.address

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            self.adapter.load()
        except Exception as e:
            log.exception("model loading failed")
            self.load_error = f"{type(e).__name__}: {e}"
            self.state = p.EngineState.FAILED
            return
        # The loaded models are a heap of long-lived objects (hundreds of thousands with torch) that every full
        # collection would walk again, pausing every thread of this process, the audio thread included, for tens
        # of milliseconds. Frozen, they leave the collector's sight; a full collection then walks only what
        # sessions allocate (benchmarks/omni_bridge.py: a 30 ms pause at 16 sessions before, none after).
        gc.collect()
        gc.freeze()
        self.state = p.EngineState.READY
        log.info("engine ready in %.1f s", time.monotonic() - t0)

    async def stop(self) -> None:
        for s in self.manager.snapshot():
            await self._close_session(s, p.CloseReason.ENGINE_SHUTDOWN)
        self._stop.set()
        self._wake.set()
        self._wake_audio()
        for t in self._threads:
            t.join(timeout=2.0)
        if self._server is not None:
            await self._server.close()
        if self.doorbell is not None:
            self.doorbell.close()

    def health(self) -> dict[str, Any]:
        return {
            "engine_pid": os.getpid(),
            "state": self.state,
            "error": self.load_error,
            "protocol": p.PROTOCOL_VERSION,
            "max_sessions": self.settings.max_sessions,
            "active_sessions": len(self.manager.sessions),
            "opened_sessions": self.manager.opened,
            "rejected_sessions": self.manager.rejected,
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "rss_bytes": psutil.Process().memory_info().rss,
            "heap": self.heap.describe(),
            "doorbell": str(self.doorbell.path) if self.doorbell else "",
            "ring_native": RING_NATIVE,  # the ingress ring's per-frame path is the C core (else pure Python)
            "audio_tick_overruns": self.audio_tick_overruns,
            "text_requests_active": len(self.texts),
            "text_requests_started": self.texts_started,
            "text_requests_rejected": self.texts_rejected,
            "max_text_requests": self.settings.thinker.max_text_requests,
            "capabilities": self.adapter.capabilities(),
            **self.adapter.describe(),
        }

    # --- control commands (event loop) -----------------------------------------------------------------------
    async def _handle(self, conn: ServerConnection, cmd: p.Command) -> p.Reply | p.ErrorReply:
        self._conns[conn.id] = conn
        match cmd:
            case p.Hello():
                conn.client, conn.pid = cmd.client, cmd.pid
                if cmd.protocol != p.PROTOCOL_VERSION:
                    return p.ErrorReply(
                        req_id=cmd.req_id,
                        code=p.ErrorCode.INVALID_REQUEST,
                        message=f"protocol {cmd.protocol} not supported; engine speaks {p.PROTOCOL_VERSION}",
                    )
                return p.Reply(req_id=cmd.req_id, result=p.EngineHealth.from_fields(self.health()))
            case p.Ping():
                return p.Reply(req_id=cmd.req_id, result=p.EngineHealth.from_fields(self.health()))
            case p.OpenSession():
                return await self._open(conn, cmd)
            case p.GetStats() if not cmd.session_id:
                return p.Reply(req_id=cmd.req_id, result=p.EngineHealth.from_fields(self.health()))
            case p.StartText():
                return await self._start_text(conn, cmd)
            case p.AbortText():
                await self._abort_text(cmd.request_id)
                return p.Reply(req_id=cmd.req_id)
        session = self.manager.get(cmd.session_id)
        if session is None or session.closing:
            return p.ErrorReply(
                req_id=cmd.req_id,
                code=p.ErrorCode.UNKNOWN_SESSION,
                message=f"no open session {cmd.session_id!r}",
            )
        session.last_activity = time.monotonic()
        match cmd:
            case p.AppendText():
                at = session.input_ms
                problem = _check_append(cmd)
                if problem:
                    return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.INVALID_REQUEST, message=problem)
                if cmd.tool_choice is not None:
                    refused = await self._check_tools(session.config.tools, cmd.tool_choice)
                    if refused:
                        return p.ErrorReply(
                            req_id=cmd.req_id, code=p.ErrorCode.INVALID_TOOLS, message=refused
                        )
                call_id = cmd.call.call_id if cmd.call is not None else cmd.call_id
                session.post(
                    TextAppend(
                        cmd.kind, cmd.text, at, cmd.max_output_tokens, cmd.tool_choice, call_id, cmd.call
                    )
                )
                return p.Reply(req_id=cmd.req_id, result=p.TextAppended(start_ms=at, end_ms=at))
            case p.SetMute():
                session.muted = cmd.muted
                session.post(MuteChange(cmd.muted))
                return p.Reply(req_id=cmd.req_id, result=p.MuteSet(muted=cmd.muted))
            case p.Interrupt():
                epoch = session.bump_epoch()
                session.post(InterruptRequest(epoch))
                return p.Reply(req_id=cmd.req_id, result=p.Interrupted(epoch=epoch))
            case p.TruncateReply():
                session.post(TruncateRequest(cmd.turn_id, cmd.text))
                return p.Reply(req_id=cmd.req_id)
            case p.UpdateSession():
                problem = _check_settings(
                    cmd.temperature, cmd.max_output_tokens, cmd.acknowledgement_delay_ms
                )
                if problem:
                    return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.INVALID_REQUEST, message=problem)
                if cmd.tools is not None or cmd.tool_choice is not None:
                    refused = await self._check_tools(
                        session.config.tools if cmd.tools is None else cmd.tools,
                        session.config.tool_choice if cmd.tool_choice is None else cmd.tool_choice,
                    )
                    if refused:
                        return p.ErrorReply(
                            req_id=cmd.req_id, code=p.ErrorCode.INVALID_TOOLS, message=refused
                        )
                session.apply_update(cmd)  # posts SettingsChange (wakes the scheduler)
                return p.Reply(req_id=cmd.req_id)
            case p.Touch():
                return p.Reply(req_id=cmd.req_id)
            case p.CloseSession():
                await self._close_session(session, cmd.reason)
                return p.Reply(req_id=cmd.req_id)
            case p.GetStats():
                return p.Reply(req_id=cmd.req_id, result=p.SessionStats.from_fields(session.snapshot()))
        return p.ErrorReply(
            req_id=cmd.req_id, code=p.ErrorCode.INVALID_REQUEST, message=f"unhandled {type(cmd).__name__}"
        )

    async def _check_tools(self, tools: list[p.ToolDef], choice: p.ToolChoiceSpec) -> str | None:
        """Whether the adapter can constrain replies to these tools: compiling their grammars takes a few ms per
        schema, so it runs off the event loop (None when there is nothing to check)."""
        if not tools and choice.mode in ("auto", "none"):
            return None
        return await asyncio.to_thread(self.adapter.check_tools, tools, choice)

    async def _open(self, conn: ServerConnection, cmd: p.OpenSession) -> p.Reply | p.ErrorReply:
        problem = _check_settings(
            cmd.config.temperature, cmd.config.max_output_tokens, cmd.config.acknowledgement_delay_ms
        )
        if problem:
            return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.INVALID_REQUEST, message=problem)
        if self.state is not p.EngineState.READY:
            code = (
                p.ErrorCode.ENGINE_LOADING
                if self.state in (p.EngineState.STARTING, p.EngineState.LOADING)
                else p.ErrorCode.INTERNAL
            )
            return p.ErrorReply(
                req_id=cmd.req_id, code=code, message=f"engine is {self.state} {self.load_error}".strip()
            )
        refused = await self._check_tools(cmd.config.tools, cmd.config.tool_choice)
        if refused:
            return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.INVALID_TOOLS, message=refused)
        try:
            rings = RingPair.attach(cmd.ingress, cmd.egress)
        except (RingError, FileNotFoundError, ValueError) as e:
            return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.RING_ERROR, message=str(e))
        ttl = cmd.config.idle_ttl_s or self.settings.idle_ttl_s
        session = DuplexSession(
            cmd.session_id, rings, cmd.config, self._emitter(conn), owner_id=conn.id, idle_ttl_s=ttl
        )
        session.on_output = self._wake_audio
        session.on_post = self._wake.set
        try:
            self.manager.admit(session)
        except AdmissionError as e:
            rings.close()
            return p.ErrorReply(req_id=cmd.req_id, code=e.code, message=str(e))
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        session.post(_Open(session, done))
        try:
            await asyncio.wrap_future(done)
        except SessionRefused as e:
            log.info("session %s: refused by the adapter: %s", session.id, e)
            self.manager.remove(session.id)
            self.manager.rejected += 1
            rings.close()
            return p.ErrorReply(req_id=cmd.req_id, code=e.code, message=str(e))
        except Exception as e:
            log.exception("session %s: adapter open failed", session.id)
            self.manager.remove(session.id)
            rings.close()
            return p.ErrorReply(req_id=cmd.req_id, code=p.ErrorCode.INTERNAL, message=f"open failed: {e}")
        log.info(
            "session %s opened (%d/%d)", session.id, len(self.manager.sessions), self.settings.max_sessions
        )
        return p.Reply(
            req_id=cmd.req_id,
            result=p.SessionOpened(session_id=session.id, epoch=session.epoch, idle_ttl_s=ttl),
        )

    # --- text requests (event loop) ---------------------------------------------------------------------------
    async def _start_text(self, conn: ServerConnection, cmd: p.StartText) -> p.Reply | p.ErrorReply:
        """Admission of a text request: refused at once when the engine is not ready or the text budget is full
        (no queue: the HTTP side answers 429), else handed to the adapter; the reply waits for its prefill."""

        def refuse(code: str, message: str) -> p.ErrorReply:
            self.texts_rejected += 1
            return p.ErrorReply(req_id=cmd.req_id, code=code, message=message)

        if not self.adapter.caps.text_completions:
            return refuse(p.ErrorCode.UNSUPPORTED, f"the {self.adapter.name!r} adapter does not run text")
        if self.state is not p.EngineState.READY:
            return refuse(p.ErrorCode.ENGINE_LOADING, f"engine is {self.state}")
        if cmd.request_id in self.texts:
            return refuse(p.ErrorCode.INVALID_REQUEST, f"text request {cmd.request_id!r} is already running")
        limit = self.settings.thinker.max_text_requests
        if len(self.texts) >= limit:
            return refuse(
                p.ErrorCode.CAPACITY_EXCEEDED, f"{limit} text requests are running; try again later"
            )
        try:
            req = TextRequest(
                cmd.request_id,
                conn.id,
                cmd.messages,
                cmd.sampling,
                self._text_emitter(conn),
                tools=cmd.tools,
                tool_choice=cmd.tool_choice,
            )
            self.adapter.submit_text(req)
        except TextRefused as e:
            return refuse(e.code, str(e))
        except ValueError as e:
            return refuse(p.ErrorCode.INVALID_REQUEST, str(e))
        self.texts[req.request_id] = req
        req.closed.add_done_callback(lambda _: self._call_soon(self.texts.pop, req.request_id, None))
        self._wake.set()
        try:
            started = await asyncio.wrap_future(req.admitted)
        except TextRefused as e:
            return refuse(e.code, str(e))
        except asyncio.CancelledError:
            req.abort_requested.set()
            self._wake.set()
            raise
        self.texts_started += 1
        return p.Reply(req_id=cmd.req_id, result=started)

    async def _abort_text(self, request_id: str) -> None:
        """End a text request now; returns once its thinker session is closed (its KV freed)."""
        req = self.texts.get(request_id)
        if req is None:
            return
        req.abort_requested.set()
        self._wake.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(req.closed), 10.0)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(fn, *args)

    def _text_emitter(self, conn: ServerConnection):
        def emit(ev: p.TextEvent) -> None:
            if not conn.closed:
                self._call_soon(conn.send, ev)

        return emit

    async def _close_session(self, session: DuplexSession, reason: p.CloseReason) -> None:
        if session.closing:
            return
        session.closing = True
        session.close_reason = reason
        session.set_state(p.SessionState.CLOSING)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        session.post(_Close(session, reason, done))
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.wrap_future(done), 10.0)

    def _end_session_threadsafe(self, session: DuplexSession, reason: p.CloseReason) -> None:
        """The adapter's model side ended this session (see ``ModelAdapter.end_session``); any thread."""
        loop = self._loop
        if loop is None or session.closing:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing
            asyncio.run_coroutine_threadsafe(self._close_session(session, reason), loop)

    def _finalize(self, session: DuplexSession, reason: p.CloseReason) -> None:
        """Scheduler thread: release the model state and the rings; tell the client."""
        try:
            self.adapter.close(session)
        except Exception:
            log.exception("session %s: adapter close failed", session.id)
        self.manager.remove(session.id)
        session.state = p.SessionState.CLOSED
        session.emit(p.SessionClosed(session_id=session.id, reason=reason))
        owner_gone = session.owner_id not in self._conns
        session.rings.close()
        if owner_gone:
            # The creator vanished: nobody else will unlink these segments.
            session.rings.ingress.unlink()
            session.rings.egress.unlink()
        session.adapter_state = None
        log.info("session %s closed: %s", session.id, reason)

    def _emitter(self, conn: ServerConnection):
        loop = self._loop
        assert loop is not None

        def emit(ev: p.SessionEvent) -> None:
            if conn.closed:
                return
            try:
                loop.call_soon_threadsafe(conn.send, ev)
            except RuntimeError:  # the loop is closing
                pass

        return emit

    def _on_disconnect(self, conn: ServerConnection) -> None:
        self._conns.pop(conn.id, None)
        orphans = [s for s in self.manager.snapshot() if s.owner_id == conn.id]
        if orphans:
            log.warning(
                "client %d (%s) disconnected; closing its %d session(s)", conn.id, conn.client, len(orphans)
            )
        for s in orphans:
            asyncio.get_running_loop().create_task(self._close_session(s, p.CloseReason.CLIENT_GONE))
        for req in [r for r in self.texts.values() if r.owner_id == conn.id]:
            req.abort_requested.set()  # the scheduler ends it at its next pass and frees its KV
            self._wake.set()

    async def _reap_idle(self) -> None:
        while not self._stop.is_set():
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for s in self.manager.snapshot():
                if not s.closing and now - s.last_activity > s.idle_ttl_s:
                    log.info("session %s idle for %.0f s: reaping", s.id, now - s.last_activity)
                    s.emit(
                        p.SessionError(
                            session_id=s.id,
                            code="idle_timeout",
                            message="session idle past its TTL",
                            fatal=True,
                        )
                    )
                    await self._close_session(s, p.CloseReason.IDLE_TIMEOUT)

    # --- audio thread ---------------------------------------------------------------------------------------
    def _wake_audio(self) -> None:
        if self.doorbell is not None:
            self.doorbell.ring()

    def _audio_loop(self) -> None:
        bell = self.doorbell
        assert bell is not None, "start() creates the doorbell before the audio thread"
        buf = np.zeros(READ_CHUNK_SAMPLES, dtype=np.int16)
        while not self._stop.is_set():
            started = time.monotonic()
            backlog = False
            for s in self.manager.snapshot():
                if s.closing:
                    continue
                try:
                    backlog |= self._pump(s, buf)
                except Exception:
                    log.exception("session %s: audio pump failed; closing it", s.id)
                    s.emit(
                        p.SessionError(
                            session_id=s.id,
                            code=p.ErrorCode.INTERNAL,
                            message="audio pump failed",
                            fatal=True,
                        )
                    )
                    if self._loop is not None:
                        asyncio.run_coroutine_threadsafe(
                            self._close_session(s, p.CloseReason.ERROR), self._loop
                        )
                    s.closing = True
            if time.monotonic() - started > AUDIO_TICK_S:  # one pass took longer than a tick: count it
                self.audio_tick_overruns += 1
            # Sleep until a producer rings (caller audio landed) or the scheduler rings (reply audio queued);
            # the doorbell is drained before wait() returns and rung after every write, so nothing written
            # during the pass is missed. Reply audio still waiting for room in egress is retried every tick.
            bell.wait(AUDIO_TICK_S if backlog else AUDIO_IDLE_WAIT_S)

    def _pump(self, s: DuplexSession, buf: np.ndarray) -> bool:
        """Move caller audio to the adapter and queued reply audio into egress; True if some is still queued."""
        ingress = s.rings.ingress
        while True:
            n = ingress.read_into(buf)
            if not n:
                break
            pcm = buf[:n]
            if s.muted:
                pcm[:] = 0  # the model hears silence; the timeline keeps moving
            s.stats.input_samples += n
            s.last_activity = time.monotonic()
            self.adapter.on_audio(s, pcm)
            if n < buf.shape[0]:
                break
        return s.drain_outbox()  # a full egress ring is retried at the next tick

    # --- scheduler thread -----------------------------------------------------------------------------------
    def _scheduler_loop(self) -> None:
        while not self._stop.is_set():
            sessions = self.manager.snapshot()
            for s in sessions:
                self._drain_mailbox(s)
            live = [s for s in self.manager.snapshot() if not s.closing and s.adapter_state is not None]
            worked = False
            if live or self.adapter.has_text_work():
                try:
                    worked = self.adapter.step(live)
                except Exception:
                    log.exception("adapter step failed")
                    for s in live:
                        s.emit(
                            p.SessionError(
                                session_id=s.id,
                                code=p.ErrorCode.INTERNAL,
                                message="model step failed",
                                fatal=False,
                            )
                        )
            # On this thread, between forward passes: a trim never delays a step that is under way.
            self.heap.maybe_trim(idle=not worked)
            if not worked:
                self._wake.wait(self.adapter.scheduler_idle_s)
                self._wake.clear()

    def _drain_mailbox(self, s: DuplexSession) -> None:
        while True:
            try:
                msg = s.mailbox.get_nowait()
            except Exception:
                return
            try:
                if isinstance(msg, _Open):
                    try:
                        self.adapter.open(s)
                    except Exception as e:
                        msg.done.set_exception(e)
                    else:
                        msg.done.set_result(None)
                elif isinstance(msg, _Close):
                    self._finalize(s, msg.reason)
                    msg.done.set_result(None)
                    # Young generations only: frees the session's reference cycles (and their tensors) now without a
                    # full collection, which stalled every other session's decode for ~60 ms.
                    gc.collect(1)
                    return
                elif not s.closing:
                    self.adapter.handle(s, msg)
            except Exception:
                log.exception("session %s: mailbox message %s failed", s.id, type(msg).__name__)


async def run_engine(settings: EngineSettings, *, ready_file: str | None = None) -> None:
    engine = Engine(settings)
    await engine.start()
    if ready_file:
        with open(ready_file, "w") as f:
            json.dump({"address": str(engine.address), "pid": os.getpid()}, f)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("engine shutting down")
    await engine.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m engine_bridge.engine --settings-json '{...}'``: how ``livekit-omni serve`` spawns the engine."""
    ap = argparse.ArgumentParser(prog="engine_bridge.engine")
    ap.add_argument("--settings-json", default="{}", help="EngineSettings as JSON")
    ap.add_argument("--ready-file", default=None, help="write {address, pid} here once listening")
    ap.add_argument("--log-level", default=os.environ.get("LIVEKIT_OMNI_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = EngineSettings.model_validate_json(args.settings_json)
    asyncio.run(run_engine(settings, ready_file=args.ready_file))


if __name__ == "__main__":
    main()
