"""The remote connection: the OpenAI Live WebSocket of a ``livekit-omni serve`` on another machine.

It behaves like LiveKit's own ``GPTLiveSession`` (docs/protocol.md) where that makes sense:

* the configuration is fixed at ``session.start`` (instructions, startup history as ``input``, PCM 24 kHz);
  every command waits for ``session.started``;
* caller audio is resampled to 24 kHz mono and sent in 100 ms ``session.input_audio.append`` chunks;
* output deltas become 24 kHz frames as they arrive (the server paces them at real time, silence included);
* the server's transcripts carry no turn boundaries, so a caller's turn starts with its first fragment and ends
  after 800 ms of pushed audio without a new one (final transcript first, then ``input_speech_stopped``);
* a dropped connection, or a session the server ends, is retried (0.1 s, then ``retry_interval_s`` doubling, at
  most ``max_retries`` times; a ``session.started`` resets the count), and ``session_reconnected`` is emitted.
  After a drop the new connection first resumes the same server session with the token of the last
  ``session.started`` (``session.resume``: its conversation, KV and pending output are still there); when the
  server refuses that (the grace ran out, or the server ended the session), it starts a new session re-seeded
  with the conversation so far as ``input``. After the last attempt, or on a fatal error code (bad key, quota),
  an unrecoverable error ends the AgentSession.

Function tools go as GPT-Live sends them, under ``delegation: responses`` (OpenAI's Live API; docs/protocol.md says
what this server serves): the agent's function tools and the tool choice in ``session.delegation.responses``
(changed with ``session.update``), a call read from a ``response.event`` envelope's ``response.output_item.done``,
its result sent back as ``response.item.create`` (a ``function_call_output``) and the answer asked for with
``response.create`` once no response is still running. Unlike GPT-Live it does not connect before the
configuration is complete, so the server never holds an idle socket.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import urlparse, urlunparse

import aiohttp
import msgspec
import numpy as np
from livekit import rtc
from livekit.agents import llm, utils

from engine_bridge import protocol as p
from livekit_omni.live import wire
from livekit_omni.plugin.log import logger
from livekit_omni.plugin.options import OmniOptions
from livekit_omni.plugin.session import (
    AppendKind,
    DropOldestQueue,
    HistoryTurn,
    OmniSession,
    frame_to_mono_pcm16,
    mono_pcm16_frame,
)
from livekit_omni.plugin.tools import INVALID_TOOLS, responses_tool_choice, responses_tools, tools_refused
from livekit_omni.sessions.resume import REFUSALS as RESUME_REFUSALS
from media.resample import Resampler

SAMPLE_RATE: Final = 24_000
#: 100 ms input chunks, as GPT-Live sends them.
INPUT_CHUNK_SAMPLES: Final = SAMPLE_RATE // 10
#: A caller's turn ends after this much pushed audio with no new transcript fragment (GPT-Live's rule).
TURN_END_MS: Final = 800
#: Commands (appends, mute) waiting for the connection; more means the server is unreachable for long.
CONTROL_QUEUE_LIMIT: Final = 256
#: On close, how long to wait for the server's ``session.closed`` (GPT-Live waits the same).
CLOSE_TIMEOUT_S: Final = 5.0
#: Startup history items per ``session.start`` (the protocol's cap).
MAX_INPUT_ITEMS: Final = 128
#: Error codes (or types) after which retrying cannot help: GPT-Live's fatal set.
FATAL_ERROR_CODES: Final = frozenset(
    {
        "insufficient_quota",
        "credit_balance_exhausted",
        "invalid_api_key",
        "account_deactivated",
        "billing_hard_limit_reached",
        "forbidden",
    }
)
#: While closing, only these server events still matter (GPT-Live does the same).
_CLOSING_EVENTS: Final = (wire.UsageUpdated, wire.SessionClosed)
#: The nested Responses events that end a backend response.
_RESPONSE_ENDS: Final = frozenset(
    {"response.completed", "response.failed", "response.incomplete", "response.cancelled"}
)


# --- the Live protocol's responses delegation ---------------------------------------------------------------------
# livekit_omni.live.wire declares the session events this client uses; the messages of a responses delegation are
# declared here, as OpenAI's Live API gives them (and LiveKit's GPT-Live sends and reads them), so that the plugin
# does not depend on the server's version of the module.


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    """A Responses input item: the result of the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponseItemCreate(msgspec.Struct, tag_field="type", tag="response.item.create", kw_only=True):
    event_id: str
    item: FunctionCallOutputItem


class ResponseCreate(msgspec.Struct, tag_field="type", tag="response.create", kw_only=True):
    event_id: str


class ResponseOutputItem(msgspec.Struct, kw_only=True):
    """The part of a Responses output item this client reads (a function call's fields)."""

    type: str = ""
    id: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    status: str | None = None


class ResponseStreamEvent(msgspec.Struct, kw_only=True):
    """A nested Responses streaming event (``response.created``, ``response.output_item.done``, ...)."""

    type: str
    item: ResponseOutputItem | None = None
    response: dict[str, Any] | None = None


class ResponseEventEnvelope(msgspec.Struct, tag_field="type", tag="response.event", kw_only=True):
    event: ResponseStreamEvent
    delegation_id: str | None = None
    event_id: str | None = None


OutgoingCommand = wire.ClientCommand | ResponseItemCreate | ResponseCreate
_response_event_decoder: Final = msgspec.json.Decoder(ResponseEventEnvelope)
_encoder: Final = msgspec.json.Encoder()


def decode_response_event(raw: str | bytes) -> ResponseEventEnvelope | None:
    """A ``response.event`` frame -> its envelope (None: the frame is some other event, or a malformed one)."""
    try:
        return _response_event_decoder.decode(raw)
    except msgspec.ValidationError:
        return None


class _Retryable(Exception):
    """The connection failed or the server ended the session: worth another attempt."""


class _Fatal(Exception):
    """The server refused in a way retrying cannot fix."""


@dataclass
class _Speech:
    """One speaker's current message, built from transcript fragments."""

    message_id: str
    text: str = ""
    end_ms: int | None = None
    started_at: float = field(default_factory=time.time)
    quiet_ms: int = 0  # caller audio pushed since the caller's last fragment


def live_sessions_url(base_url: str) -> str:
    """``http://host:8080/v1`` → ``ws://host:8080/v1/live/sessions`` (the path GPT-Live builds; query dropped)."""
    parsed = urlparse(base_url)
    scheme = {"http": "ws", "https": "wss"}.get(parsed.scheme, parsed.scheme)
    path = parsed.path.rstrip("/")
    if not path.endswith("/live/sessions"):
        path = f"{path}/live/sessions"
    return urlunparse((scheme, parsed.netloc, path, "", "", ""))


def health_url(base_url: str) -> str:
    """``http://host:8080/v1`` → ``http://host:8080/health`` (health lives at the server root)."""
    parsed = urlparse(base_url)
    scheme = {"ws": "http", "wss": "https"}.get(parsed.scheme, parsed.scheme)
    return urlunparse((scheme, parsed.netloc, "/health", "", "", ""))


def _mute_command(muted: bool) -> wire.InputAudioMute | wire.InputAudioUnmute:
    event_id = utils.shortuuid("mute_")
    return wire.InputAudioMute(event_id=event_id) if muted else wire.InputAudioUnmute(event_id=event_id)


class RemoteSession(OmniSession):
    """One Live session on a remote ``livekit-omni serve``; see the module docstring."""

    def __init__(self, model: llm.DuplexModel, options: OmniOptions) -> None:
        super().__init__(model, options)
        assert self._opts.base_url is not None
        self._url = live_sessions_url(self._opts.base_url)
        self._out: DropOldestQueue[llm.DuplexAudioFrame] = DropOldestQueue(self._opts.output_queue_frames)
        self._control: collections.deque[OutgoingCommand] = collections.deque()
        self._wake = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        # Per connection.
        self._session_id: str | None = None
        self._session_started = asyncio.Event()
        self._session_closed = asyncio.Event()
        self._closed_reason = ""
        self._usage_total = 0.0
        #: The token of the last session.started (None: nothing to resume, the next connection starts afresh).
        self._resume_token: str | None = None
        self._resume_refused = asyncio.Event()
        #: How many times a reconnect resumed the server session (and how many were refused).
        self.resumes = 0
        self.resumes_refused = 0
        # Input conversion state (reset per connection: a partial chunk never crosses sessions).
        self._resampler: Resampler | None = None
        self._chunk = np.zeros(INPUT_CHUNK_SAMPLES, dtype=np.int16)
        self._chunk_fill = 0
        self._speech: dict[Literal["user", "assistant"], _Speech] = {}
        #: Backend responses running (by delegation id; None: one the client started), and whether a
        #: ``response.create`` waits for them to end (the service continues only once none is running).
        self._responses_running: set[str | None] = set()
        self._continue_pending = False
        self._retries = 0
        self._stream = self._frames()
        self._main = asyncio.create_task(self._main_task(), name="omni.remote.main")

    # --- DuplexSession ------------------------------------------------------------------------------------------
    @property
    def audio_stream(self) -> AsyncIterator[llm.DuplexAudioFrame]:
        return self._stream

    @property
    def session_id(self) -> str | None:
        """The server's id of the current Live session."""
        return self._session_id

    @property
    def output_frames_dropped(self) -> int:
        return self._out.dropped

    async def wait_ready(self) -> bool:
        # The started event is replaced per connection, so poll the current one (cheaply) until it is set.
        while not self._session_started.is_set():
            if self._failed or self._closing or self._main.done():
                return False
            await asyncio.sleep(0.02)
        return True

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        super().push_audio(frame)
        # The caller's turn ends on their own audio: this much pushed since their last fragment.
        if (speech := self._speech.get("user")) is not None:
            speech.quiet_ms += round(frame.duration * 1000)
            if speech.quiet_ms >= TURN_END_MS:
                self._end_speech("user")
        self._wake.set()

    async def aclose(self) -> None:
        await super().aclose()
        self._input.close()
        self._wake.set()
        # The main task sends session.close and waits (bounded) for session.closed; past that it is cancelled.
        try:
            await asyncio.wait_for(asyncio.shield(self._main), CLOSE_TIMEOUT_S + 1.0)
        except (TimeoutError, asyncio.CancelledError):
            await utils.aio.cancel_and_wait(self._main)
        except Exception:
            logger.exception("livekit-omni remote session ended with an error")
        self._out.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # --- subclass verbs -------------------------------------------------------------------------------------------
    def _send_append(self, kind: AppendKind, text: str) -> None:
        event_id = utils.shortuuid("append_")
        command: wire.TextAppend
        if kind == "instructions":
            command = wire.InstructionsAppend(event_id=event_id, content=text, delegation_id=None)
        elif kind == "thinking":
            command = wire.ThinkingAppend(event_id=event_id, content=text, delegation_id=None)
        else:
            command = wire.CommentaryAppend(event_id=event_id, content=text, delegation_id=None)
        self._queue_command(command)

    def _request_reply(self, instructions: str | None) -> None:
        # The Live protocol has no reply verb: commentary is "say this now, in your own words". A bare ask is the
        # engine's speak-now: an empty commentary.
        self._send_append("commentary", instructions or "")

    def _send_mute(self, muted: bool) -> None:
        self._queue_command(_mute_command(muted))

    async def _apply_tools(self, tools: list[p.ToolDef], choice: p.ToolChoiceSpec) -> None:
        # The server answers with session.updated, or an error event (reported as an error, with the tools named).
        self._queue_delegation_update(
            {"tools": responses_tools(tools), "tool_choice": responses_tool_choice(choice)}
        )

    def _send_tool_choice(self, choice: p.ToolChoiceSpec) -> None:
        self._queue_delegation_update({"tool_choice": responses_tool_choice(choice)})

    def _queue_delegation_update(self, responses: dict[str, Any]) -> None:
        update = wire.UpdateConfig(delegation=wire.Delegation(type="responses", responses=responses))
        self._queue_command(
            wire.SessionUpdate(event_id=utils.shortuuid("delegation_update_"), session=update)
        )

    def _send_tool_result(self, call_id: str, output: str) -> None:
        item = FunctionCallOutputItem(type="function_call_output", call_id=call_id, output=output)
        self._queue_command(ResponseItemCreate(event_id=utils.shortuuid("tool_output_"), item=item))

    def _send_tool_call(self, call: llm.FunctionCall) -> bool:
        return False  # the Live wire has no client-made calls: it is narrated as context

    def _request_tool_reply(self, choice: p.ToolChoiceSpec) -> None:
        # The session's tool choice was set with session.update (the framework sets it before it asks); the
        # Live protocol's response.create takes none of its own.
        if self._responses_running:
            self._continue_pending = True  # sent once they end
            return
        self._queue_command(ResponseCreate(event_id=utils.shortuuid("response_create_")))

    def _queue_command(self, event: OutgoingCommand) -> None:
        if self._closing or self._failed:
            raise llm.RealtimeError("the livekit-omni session is closed")
        if len(self._control) >= CONTROL_QUEUE_LIMIT:
            raise llm.RealtimeError(
                f"{CONTROL_QUEUE_LIMIT} commands are waiting for the server; it is not reachable",
                code="server_unreachable",
            )
        self._control.append(event)
        self._wake.set()

    # --- connection loop --------------------------------------------------------------------------------------
    async def _main_task(self) -> None:
        try:
            # Instructions and startup history are fixed at session.start: wait until the framework set them.
            await self._configured.wait()
            reconnecting = False
            while not self._closing:
                try:
                    ws = await self._connect()
                    if reconnecting:
                        self._reset_for_reconnect(resuming=self._resume_token is not None)
                        self.emit("session_reconnected", llm.RealtimeSessionReconnectedEvent())
                    await self._run_ws(ws)
                except _Fatal as e:
                    if isinstance(e.__cause__, llm.RealtimeError):
                        self._refuse_tools(e.__cause__)  # the session was refused for its tools
                    else:
                        self._emit_error(llm.RealtimeError(str(e), code="fatal"), recoverable=False)
                    return
                except _Retryable as e:
                    if self._closing:
                        return
                    if self._retries >= self._opts.max_retries:
                        self._emit_error(
                            llm.RealtimeError(
                                f"livekit-omni server at {self._url} unavailable after "
                                f"{self._retries + 1} attempts: {e}",
                                code="connection_failed",
                            ),
                            recoverable=False,
                        )
                        return
                    self._emit_error(llm.RealtimeError(str(e), code="connection_lost"), recoverable=True)
                    delay = self._retry_delay(self._retries)
                    self._retries += 1
                    logger.warning("livekit-omni: %s; retry %d in %.1f s", e, self._retries, delay)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wait_closing(), delay)
                reconnecting = True
        finally:
            self._out.close()

    def _retry_delay(self, attempt: int) -> float:
        if attempt == 0:
            return 0.1
        return min(self._opts.retry_interval_s * 2 ** (attempt - 1), 10.0)

    async def _connect(self) -> aiohttp.ClientWebSocketResponse:
        if self._http is None:
            self._http = aiohttp.ClientSession()
        headers = {"User-Agent": "livekit-omni plugin"}
        if self._opts.api_key:
            headers["Authorization"] = f"Bearer {self._opts.api_key}"
        t0 = time.perf_counter()
        try:
            ws = await asyncio.wait_for(
                self._http.ws_connect(self._url, headers=headers, max_msg_size=8 * 1024 * 1024),
                self._opts.connect_timeout_s,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise _Retryable(f"connecting to {self._url} failed: {e or type(e).__name__}") from None
        self._report_connection_acquired(time.perf_counter() - t0)
        return ws

    def _reset_for_reconnect(self, *, resuming: bool) -> None:
        # What the old connection was carrying (a partial chunk, an open caller turn) does not continue. Caller
        # audio queued during the outage is dropped too: a duplex model hears in real time, and seconds-old speech
        # replayed into the session would be taken for a turn the caller is taking now. A resumed session keeps
        # its id and cumulative usage; a new one (re-seeded from the history) starts both afresh.
        self._input.dropped += self._input.clear()
        self._end_speech("user")
        self._end_speech("assistant")
        self._speech.clear()
        self._resampler = None
        self._chunk_fill = 0
        # A response the old connection was following is not reported on the new one.
        self._responses_running.clear()
        if not resuming:
            self._usage_total = 0.0
            self._session_id = None
            # The new session never saw the calls: their results are context, and nothing is left to continue.
            self._forget_calls()
            self._continue_pending = False
        elif self._continue_pending and not self._closing:
            # The resumed session still holds the calls and their results: the answer asked for goes out now.
            self._continue_pending = False
            self._queue_command(ResponseCreate(event_id=utils.shortuuid("response_create_")))

    async def _run_ws(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._session_started = asyncio.Event()
        self._session_closed = asyncio.Event()
        self._resume_refused = asyncio.Event()
        self._closed_reason = ""
        try:
            if self._closing:
                return
            token, self._resume_token = self._resume_token, None
            if token is not None:
                await self._send(
                    ws, wire.SessionResume(event_id=utils.shortuuid("session_resume_"), resume_token=token)
                )
            else:
                await self._send(ws, self._session_start_event())
            self._config_sent = True
            recv = asyncio.create_task(self._recv_loop(ws), name="omni.remote.recv")
            send = asyncio.create_task(self._send_loop(ws), name="omni.remote.send")
            try:
                done, _ = await asyncio.wait({recv, send}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
                if send in done and not recv.done():
                    # A clean close: session.close was sent and the socket closed; let recv see the close.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(recv), 1.0)
            finally:
                await utils.aio.cancel_and_wait(recv, send)
        finally:
            # What arrives from now on is history for the next connection, not an append.
            self._config_sent = False
            await ws.close()
        if not self._closing:
            if self._session_closed.is_set():
                raise _Retryable(f"the server ended the session ({self._closed_reason or 'no reason'})")
            raise _Retryable("the connection closed unexpectedly")

    async def _send(self, ws: aiohttp.ClientWebSocketResponse, event: OutgoingCommand) -> None:
        if not isinstance(event, wire.InputAudioAppend):
            self.emit("omni_client_event", event)
        try:
            await ws.send_str(_encoder.encode(event).decode())
        except (aiohttp.ClientError, ConnectionError, OSError) as e:
            raise _Retryable(f"send failed: {e}") from None

    async def _send_loop(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        # The protocol wants session.started before any audio or command.
        while True:
            started = asyncio.create_task(self._session_started.wait())
            closing = asyncio.create_task(self._wait_closing())
            refused = asyncio.create_task(self._resume_refused.wait())
            try:
                await asyncio.wait({started, closing, refused}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await utils.aio.cancel_and_wait(started, closing, refused)
            if self._session_started.is_set() or self._closing or not self._resume_refused.is_set():
                break
            # The server could not resume the session (it has ended): a new one on this connection, re-seeded.
            self._resume_refused.clear()
            self._reset_for_reconnect(resuming=False)
            await self._send(ws, self._session_start_event())
        if self._session_started.is_set() and self._input_muted:
            # A new session starts unmuted; the mute the app asked for is re-applied before it hears anything.
            await self._send(ws, _mute_command(True))
        while not self._closing:
            while self._control:
                await self._send(ws, self._control.popleft())
            while (frame := self._input.get_nowait()) is not None:
                for chunk in self._to_chunks(frame):
                    audio = base64.b64encode(chunk.tobytes()).decode("ascii")
                    await self._send(ws, wire.InputAudioAppend(audio=audio))
            self._wake.clear()
            if not self._control and not len(self._input):
                await self._wake.wait()
        # Closing: ask the server to finalize, wait (bounded) for session.closed, then close.
        if self._session_started.is_set():
            with contextlib.suppress(_Retryable):
                await self._send(ws, wire.SessionClose())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._session_closed.wait(), CLOSE_TIMEOUT_S)
        await ws.close()

    async def _wait_closing(self) -> None:
        while not self._closing:
            self._wake.clear()
            await self._wake.wait()

    def _to_chunks(self, frame: rtc.AudioFrame) -> list[np.ndarray]:
        """Caller audio → 24 kHz mono, cut into 100 ms chunks (a partial chunk waits for the next frame)."""
        pcm = frame_to_mono_pcm16(frame)
        if self._resampler is None or self._resampler.in_rate != frame.sample_rate:
            self._resampler = Resampler.for_rates(frame.sample_rate, SAMPLE_RATE)
        pcm = self._resampler.process(pcm)
        chunks: list[np.ndarray] = []
        pos = 0
        while pos < pcm.shape[0]:
            take = min(INPUT_CHUNK_SAMPLES - self._chunk_fill, pcm.shape[0] - pos)
            self._chunk[self._chunk_fill : self._chunk_fill + take] = pcm[pos : pos + take]
            self._chunk_fill += take
            pos += take
            if self._chunk_fill == INPUT_CHUNK_SAMPLES:
                chunks.append(self._chunk.copy())
                self._chunk_fill = 0
        return chunks

    async def _recv_loop(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    try:
                        event = wire.decode_server_event(msg.data)
                    except msgspec.DecodeError:
                        raise _Fatal("the server sent a text frame that is not a JSON object") from None
                    except wire.UnknownServerEvent as e:
                        # A responses delegation's event (declared here, see above), or one this client does
                        # not know or a malformed one: skipped, as GPT-Live does.
                        if (envelope := decode_response_event(msg.data)) is not None:
                            self.emit("omni_server_event", envelope)
                            if not self._closing:
                                self._on_response_event(envelope)
                        else:
                            logger.debug("livekit-omni: skipping a server event: %s", e)
                        continue
                    if wire.event_type(event) == ResponseEventEnvelope.__struct_config__.tag:
                        # A server module that declares the envelope itself: read with this client's fields.
                        if (envelope := decode_response_event(msg.data)) is not None and not self._closing:
                            self._on_response_event(envelope)
                    self.emit("omni_server_event", event)
                    if self._closing and not isinstance(event, _CLOSING_EVENTS):
                        continue  # the framework has torn down; only the shutdown events matter
                    self._handle_event(event)
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    raise _Retryable(f"receive failed: {ws.exception()}")
        except (aiohttp.ClientError, ConnectionError) as e:
            raise _Retryable(f"receive failed: {e}") from None

    # --- server events ------------------------------------------------------------------------------------------
    def _handle_event(self, event: wire.ServerEvent) -> None:
        match event:
            case wire.OutputAudioDelta():
                self._on_audio_delta(event.delta)
            case wire.OutputTranscriptDelta():
                self._on_transcript("assistant", event)
            case wire.InputTranscriptDelta():
                self._on_transcript("user", event)
            case wire.SessionStarted():
                if event.session.id and event.session.id == self._session_id:
                    self.resumes += 1
                self._session_id = event.session.id or self._session_id
                self._resume_token = event.resume_token
                self._retries = 0
                self._session_started.set()
            case wire.UsageUpdated():
                self._on_usage(event.usage)
            case wire.SessionClosed():
                self._on_usage(event.usage)
                self._resume_token = None  # the server ended it: there is nothing to resume
                self._closed_reason = event.reason
                self._session_closed.set()
            case wire.Error():
                self._on_error(event.error)
            case _:
                logger.debug("livekit-omni server event %s", wire.event_type(event))

    def _on_response_event(self, envelope: ResponseEventEnvelope) -> None:
        """The backend's stream, read as GPT-Live reads it: a completed function call is LiveKit's to run."""
        event, delegation = envelope.event, envelope.delegation_id
        if event.type == "response.created":
            self._responses_running.add(delegation)
        elif event.type == "response.output_item.done":
            item = event.item
            if item is None or item.type != "function_call" or item.status not in (None, "completed"):
                return
            if not item.call_id or not item.name or item.arguments is None:
                logger.warning("livekit-omni: dropping a function call with missing fields: %s", item)
                return
            self._emit_function_call(item.call_id, item.name, item.arguments, item.id)
        elif event.type in _RESPONSE_ENDS:
            self._responses_running.discard(delegation)
            if self._continue_pending and not self._responses_running:
                self._continue_pending = False
                self._queue_command(ResponseCreate(event_id=utils.shortuuid("response_create_")))

    def _on_audio_delta(self, data: bytes) -> None:
        # Decoded from base64 with the event; odd-length chunks are not whole samples (GPT-Live drops them too).
        if not data or len(data) % 2:
            return
        frame = mono_pcm16_frame(data, SAMPLE_RATE)
        self._out.put(llm.DuplexAudioFrame(frame=frame))

    def _on_transcript(
        self,
        role: Literal["user", "assistant"],
        event: wire.InputTranscriptDelta | wire.OutputTranscriptDelta,
    ) -> None:
        delta, start_ms, end_ms = event.delta, event.start_ms, event.end_ms
        if not delta:
            return
        speech = self._speech.get(role)
        # A pause on the server's clock ends the message even when its fragments arrived together.
        if speech is not None and speech.end_ms is not None and start_ms - speech.end_ms > TURN_END_MS:
            self._end_speech(role)
            speech = None
        if speech is None:
            speech = self._speech[role] = _Speech(message_id=utils.shortuuid(f"omni_{role}_"))
            if role == "user":
                # A caller's message starts with its first words (the Live wire has no turn boundaries).
                self._note_caller_turn()
                self.emit("input_speech_started", llm.InputSpeechStartedEvent())
        speech.text += delta
        speech.quiet_ms = 0
        speech.end_ms = max(speech.end_ms or 0, end_ms)
        if role == "user":
            self.emit(
                "input_audio_transcription_completed",
                llm.InputTranscriptionCompleted(
                    item_id=speech.message_id,
                    transcript=speech.text,
                    is_final=False,
                    turn_started_at=speech.started_at,
                ),
            )
        else:
            self.emit(
                "transcript_delta",
                llm.DuplexOutputTranscriptDelta(text=delta, start_ms=start_ms, end_ms=end_ms),
            )

    def _end_speech(self, role: Literal["user", "assistant"]) -> None:
        """Close a speaker's message: it joins the history; for the caller it also ends the turn."""
        if (speech := self._speech.pop(role, None)) is None:
            return
        if speech.text.strip():
            self._history.append(HistoryTurn(role, speech.text.strip()))
        if role != "user":
            return
        self._first_sight(speech.message_id)
        # The final transcript goes out first, so nothing waits for one after the stop.
        self.emit(
            "input_audio_transcription_completed",
            llm.InputTranscriptionCompleted(
                item_id=speech.message_id,
                transcript=speech.text,
                is_final=True,
                turn_started_at=speech.started_at,
            ),
        )
        self.emit("input_speech_stopped", llm.InputSpeechStoppedEvent(user_transcription_enabled=False))

    def _on_usage(self, usage: wire.SessionUsage) -> None:
        # Reported cumulatively per session; only the delta goes to LiveKit's collector.
        previous, self._usage_total = self._usage_total, usage.seconds
        self._emit_usage(max(0.0, self._usage_total - previous), self._session_id or "")

    def _on_error(self, error: wire.ErrorDetail) -> None:
        code, etype = error.code, error.type
        # A refused session.resume leaves the connection usable for a new session.
        if code in RESUME_REFUSALS and not self._session_started.is_set():
            logger.info(
                "livekit-omni: the server could not resume the session (%s); starting a new one", code
            )
            self.resumes_refused += 1
            self._resume_refused.set()
            return
        message = f"server error {code or etype}: {error.message}"
        if code in FATAL_ERROR_CODES or etype in FATAL_ERROR_CODES:
            raise _Fatal(message)
        if self._tool_defs and (code == INVALID_TOOLS or "tool" in (error.param or "")):
            refused = tools_refused(f"{error.message} ({error.param or code})", self._tool_defs)
            if not self._session_started.is_set():
                # session.start was refused for the tools: the same start can never succeed.
                raise _Fatal(str(refused)) from refused
            self._emit_error(refused, recoverable=True)
            return
        self._emit_error(llm.RealtimeError(message, code=code), recoverable=True)

    # --- output -----------------------------------------------------------------------------------------------
    def _session_start_event(self) -> wire.SessionStart:
        """The whole configuration, rebuilt for each connection: a reconnect carries the conversation so far."""
        items = [
            wire.InitialItem(
                type="message",
                role=turn.role,
                content=[
                    wire.TextPart(
                        type="output_text" if turn.role == "assistant" else "input_text", text=turn.text
                    )
                ],
            )
            for turn in list(self._history)[-MAX_INPUT_ITEMS:]
        ]
        session = wire.StartConfig(
            model=self._opts.model,
            instructions=self._instructions or None,
            input=items or None,
            audio=wire.AudioConfig(
                format=wire.AudioFormat(type="audio/pcm", rate=SAMPLE_RATE),
                output=wire.AudioOutput(voice=self._opts.voice) if self._opts.voice else None,
            ),
            delegation=self._delegation(),
        )
        return wire.SessionStart(event_id=utils.shortuuid("session_start_"), session=session)

    def _delegation(self) -> wire.Delegation:
        """A responses delegation (GPT-Live's default), so that tools can come and go during the session (its type
        is fixed at start): the agent's function tools and the tool choice; the server's own model answers."""
        responses: dict[str, Any] = {"model": self._opts.model}
        if self._tool_defs:
            responses["tools"] = responses_tools(self._tool_defs)
            responses["tool_choice"] = responses_tool_choice(self.tool_choice)
        ack = self._opts.acknowledgement_delay_ms
        return wire.Delegation(
            type="responses", responses=responses, acknowledgement_delay_ms=ack if ack >= 0 else None
        )

    async def _frames(self) -> AsyncIterator[llm.DuplexAudioFrame]:
        async for frame in self._out:
            yield frame
