"""The co-located connection: the agent process drives an engine session on the same host directly.

Data plane: once the session is open, ``push_audio`` resamples each caller frame straight into the session's
shared-memory ingress ring with :class:`media.ingress.IngressWriter` (bounded work that never waits: a full ring
drops the frame and counts it). Frames pushed before that, or behind such a backlog, are queued (bounded,
drop-oldest) and a task writes them in order. The output stream is an :class:`media.egress.EgressPlayer` read once
per 20 ms tick of a :class:`media.pacer.Pacer`: one 24 kHz frame per tick, digital zeros between utterances,
stale-epoch audio dropped within a frame of a barge-in, the playout position reported back to the engine, and the
model's words released with the frame that plays them.

Wake-ups: a caller frame arriving less than a frame before the next output tick releases that tick at once
(``Pacer.nudge``), so while the caller's audio flows the process wakes once per 20 ms for both directions
instead of twice; the output frame leaves up to one frame early, never late, and the pacer's own timer takes over
when the caller's frames stop.

The writer, the player, the engine event pump and the keep-alive belong to the session's
:class:`media.bridge.SessionBridge`, as for the Live facade's sessions (one keep-alive rule: see there).

Control plane: the engine's local channel (:class:`engine_bridge.client.EngineClient`), shared by the model's
sessions on one event loop. Engine events become LiveKit duplex events here; a reply that ended in function calls
(``ReplyDone.tool_calls``) becomes LiveKit's ``function_call`` events, their results go back as ``tool_result``
appends and the answer is a ``respond`` append (see :mod:`.session`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Final

from livekit import rtc
from livekit.agents import llm, utils

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient, EngineSession
from engine_bridge.control import ControlError, EngineRequestError
from engine_bridge.formats import ENGINE_OUTPUT_RATE, FRAME_MS
from livekit_omni.plugin.gate import IN_REPLY
from livekit_omni.plugin.log import logger
from livekit_omni.plugin.options import OmniOptions
from livekit_omni.plugin.session import (
    AppendKind,
    OmniBargeIn,
    OmniReplyDone,
    OmniSession,
    frame_to_mono_pcm16,
    mono_pcm16_frame,
)
from livekit_omni.plugin.tools import tools_refused
from media.bridge import SessionBridge
from media.egress import EgressPlayer
from media.ingress import IngressWriter
from media.pacer import Pacer

#: Control commands (appends, mute, interrupt) waiting for the engine. Each takes a round trip of well under a
#: millisecond on a local socket; 64 waiting means the engine is gone or stuck, and the caller gets an error.
COMMAND_QUEUE_LIMIT: Final = 64
#: Output rate of the frames handed to LiveKit: the engine's own, so nothing is resampled on the way out.
OUTPUT_RATE: Final = ENGINE_OUTPUT_RATE

Command = Callable[[EngineSession], Awaitable[Any]]
#: Gives the control connection a session opens on, connected: the model's one per event loop, shared by its
#: sessions and replaced once lost. A getter rather than a client because it connects on first use, when the
#: session opens (after ``session()`` returned), and a lost connection is replaced for the next session.
EngineClientGetter = Callable[[], Awaitable[EngineClient]]


class ColocatedSession(OmniSession):
    """One engine session reached through the shared-memory rings; see the module docstring."""

    def __init__(
        self, model: llm.DuplexModel, options: OmniOptions, *, engine_client: EngineClientGetter
    ) -> None:
        super().__init__(model, options)
        self._engine_client = engine_client
        self._es: EngineSession | None = None
        self._bridge: SessionBridge | None = None
        self._writer: IngressWriter | None = None
        self._player: EgressPlayer | None = None
        #: Set once the open attempt is over (succeeded, failed, or abandoned by aclose).
        self._open_done = asyncio.Event()
        self._commands: asyncio.Queue[Command] = asyncio.Queue(COMMAND_QUEUE_LIMIT)
        self._stream_closed = False
        self._stream = self._frames()
        # The caller's current turn: when it began (wall clock) and the held input_speech_stopped.
        self._turn_started_at: float | None = None
        self._stop_timer: asyncio.TimerHandle | None = None
        self._usage_seconds = 0.0
        #: The engine's reply in progress (ReplyStarted seen, no ReplyDone yet): its frames are marked for OmniGate.
        self._reply_turn: int | None = None
        #: The output clock; caller frames nudge it (see the module docstring).
        self._pacer = Pacer(early_s=FRAME_MS / 1000)
        self._main = asyncio.create_task(self._run(), name="omni.colocated.main")

    # --- DuplexSession ------------------------------------------------------------------------------------------
    @property
    def audio_stream(self) -> AsyncIterator[llm.DuplexAudioFrame]:
        return self._stream

    @property
    def engine_session_id(self) -> str | None:
        return self._es.id if self._es is not None else None

    async def wait_ready(self) -> bool:
        await self._open_done.wait()
        return self._es is not None and not self._es.closed

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        writer = self._writer
        if writer is not None and not self._input and not self._stream_closed:
            # Nothing queued ahead of it: into the ring now. The hop to the input task would do the same work on
            # the same loop a moment later, plus the hop.
            self._write_input(writer, frame)
        else:
            self._input.put(frame)
        self._pacer.nudge()

    def interrupt(self) -> None:
        """Stop the model's speech now (the engine bumps the epoch; queued audio is dropped within a frame)."""
        self._enqueue(lambda es: es.interrupt())

    async def engine_stats(self) -> p.SessionStats:
        """The engine's own view of the session: its conversation log, turns, barge-ins, playout."""
        if self._es is None or self._es.closed:
            raise llm.RealtimeError("the engine session is not open")
        return await self._es.stats()

    def stats(self) -> dict[str, Any]:
        """Counters of the data plane: input queue drops, ring writes and overruns, output frames."""
        return {
            "input_frames_dropped": self._input.dropped,
            "ingress": self._writer.stats() if self._writer else {},
            "egress": self._player.stats() if self._player else {},
        }

    async def aclose(self) -> None:
        await super().aclose()
        self._stream_closed = True
        self._input.close()
        if self._stop_timer is not None:
            self._stop_timer.cancel()
            self._stop_timer = None
        await utils.aio.cancel_and_wait(self._main)
        if self._bridge is not None:
            # Stops the media (nothing touches the rings afterwards), then closes the engine session and releases
            # (unlinks) the rings.
            await self._bridge.close(p.CloseReason.CLIENT)
        elif self._es is not None:
            await self._es.close(p.CloseReason.CLIENT)
        self._open_done.set()
        # Normally the adapter's segmenter owns the stream and is cancelled before this; a stream still
        # suspended elsewhere ends at its next tick (it checks _stream_closed).
        with contextlib.suppress(RuntimeError):
            await self._stream.aclose()

    # --- subclass verbs -------------------------------------------------------------------------------------------
    def _send_append(self, kind: AppendKind, text: str) -> None:
        self._enqueue(lambda es: es.append_text(kind, text))

    def _request_reply(self, instructions: str | None) -> None:
        # The engine's commentary is "say this now, in your own words"; speak_now is "reply now".
        if instructions:
            self._enqueue(lambda es: es.append_text("commentary", instructions))
        else:
            self._enqueue(lambda es: es.append_text("speak_now", ""))

    def _send_mute(self, muted: bool) -> None:
        self._enqueue(lambda es: es.set_mute(muted))

    async def _apply_tools(self, tools: list[p.ToolDef], choice: p.ToolChoiceSpec) -> None:
        # In order with the appends before it, and awaited: the engine's refusal is this call's error.
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def update(es: EngineSession) -> None:
            try:
                await es.update(tools=tools, tool_choice=choice)
            except Exception as e:  # handed to the caller, which raises it
                if not done.done():
                    done.set_exception(e)
            else:
                if not done.done():
                    done.set_result(None)

        self._enqueue(update)
        try:
            await done
        except EngineRequestError as e:
            if e.code == p.ErrorCode.INVALID_TOOLS:
                raise tools_refused(e.message, tools) from None
            raise llm.RealtimeError(f"the engine refused the new tools: {e}", code=e.code) from None
        except (ControlError, TimeoutError) as e:
            raise llm.RealtimeError(f"the engine did not take the new tools: {e}") from None

    def _send_tool_choice(self, choice: p.ToolChoiceSpec) -> None:
        self._enqueue(lambda es: es.update(tool_choice=choice))

    def _send_tool_result(self, call_id: str, output: str) -> None:
        self._enqueue(lambda es: es.append_text("tool_result", output, call_id=call_id))

    def _send_tool_call(self, call: llm.FunctionCall) -> bool:
        item = p.ToolCallItem(call_id=call.call_id, name=call.name, arguments=call.arguments)
        self._enqueue(lambda es: es.append_text("tool_call", "", call=item))
        return True

    def _request_tool_reply(self, choice: p.ToolChoiceSpec) -> None:
        # The reply to the conversation as it stands (the results at its end), with no prompt added.
        self._enqueue(lambda es: es.append_text("respond", "", tool_choice=choice))

    def _enqueue(self, cmd: Command) -> None:
        if self._closing or self._failed:
            raise llm.RealtimeError("the livekit-omni session is closed")
        try:
            self._commands.put_nowait(cmd)
        except asyncio.QueueFull:
            raise llm.RealtimeError(
                f"{COMMAND_QUEUE_LIMIT} commands are waiting for the engine; it is not answering",
                code="engine_busy",
            ) from None

    # --- the session's life ---------------------------------------------------------------------------------------
    def _session_config(self) -> p.SessionConfig:
        # From here on, context goes to the engine as appends (queued until the session is open).
        self._config_sent = True
        return p.SessionConfig(
            instructions=self._instructions,
            history=[p.ChatTurn(role=t.role, text=t.text) for t in self._startup_history()],
            voice=self._opts.voice,
            idle_ttl_s=self._opts.idle_ttl_s,
            tools=list(self._tool_defs),
            tool_choice=self.tool_choice,
            acknowledgement_delay_ms=self._opts.acknowledgement_delay_ms,
        )

    async def _open(self) -> EngineSession:
        """Open the engine session; an engine still loading its models is waited for up to the connect timeout."""
        deadline = time.monotonic() + self._opts.connect_timeout_s
        config = self._session_config()
        while True:
            client = await self._engine_client()
            try:
                return await client.open_session(config, timeout=self._opts.connect_timeout_s)
            except EngineRequestError as e:
                if e.code != p.ErrorCode.ENGINE_LOADING or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.25)

    async def _run(self) -> None:
        # The configuration (instructions, startup history) is fixed at open, so wait until it is complete.
        await self._configured.wait()
        if self._closing:
            self._open_done.set()
            return
        t0 = time.perf_counter()
        try:
            es = await self._open()
        except asyncio.CancelledError:
            raise
        except EngineRequestError as e:
            if e.code != p.ErrorCode.INVALID_TOOLS:
                self._open_failed(e)
                return
            self._refuse_tools(tools_refused(e.message, self._tool_defs))
            self._open_done.set()
            return
        except Exception as e:
            self._open_failed(e)
            return
        self._es = es
        self._bridge = bridge = SessionBridge(es, self._on_engine_event)
        self._writer = bridge.writer
        self._player = bridge.open_output(rate=OUTPUT_RATE)
        self._report_connection_acquired(time.perf_counter() - t0)
        logger.info("livekit-omni session %s opened on %s", es.id, self._opts.engine_address)
        self._open_done.set()
        helpers = [
            asyncio.create_task(self._pump_input(self._writer), name="omni.colocated.input"),
            asyncio.create_task(self._pump_commands(es), name="omni.colocated.commands"),
        ]
        bridge.start()
        try:
            await bridge.wait()  # until the engine session's events end
        finally:
            await utils.aio.cancel_and_wait(*helpers)

    def _open_failed(self, e: Exception) -> None:
        where = self._opts.engine_address
        self._emit_error(
            llm.RealtimeError(f"could not open a session on the engine at {where}: {e}", code="open_failed"),
            recoverable=False,
        )
        self._open_done.set()

    async def _pump_input(self, writer: IngressWriter) -> None:
        """Writes the frames queued before the writer ran (or behind them), in order; later ones go directly."""
        while (frame := await self._input.get()) is not None:
            self._write_input(writer, frame)

    @staticmethod
    def _write_input(writer: IngressWriter, frame: rtc.AudioFrame) -> None:
        try:
            writer.write_pcm16(frame_to_mono_pcm16(frame), frame.sample_rate)
        except (TypeError, ValueError) as e:
            logger.warning("dropping a caller frame the engine cannot take: %s", e)

    async def _pump_commands(self, es: EngineSession) -> None:
        while True:
            cmd = await self._commands.get()
            try:
                await cmd(es)
            except (ControlError, TimeoutError) as e:
                if not es.closed:
                    self._emit_error(llm.RealtimeError(f"engine command failed: {e}"), recoverable=True)

    def _on_engine_event(self, ev: p.SessionEvent) -> None:
        match ev:
            case p.SpeechStarted():
                self._release_stop()
                self._turn_started_at = time.time()
                self.emit("input_speech_started", llm.InputSpeechStartedEvent())
            case p.SpeechStopped():
                self._hold_stop()
            case p.InputTranscript():
                started = self._turn_started_at
                if started is None:
                    started = time.time() - max(ev.end_ms - ev.start_ms, 0) / 1000
                if ev.final:
                    # The framework records the caller's message under this id; a context update carrying it
                    # back must not reach the engine a second time.
                    self._first_sight(ev.item_id)
                    if ev.text.strip():
                        self._note_caller_turn()
                self.emit(
                    "input_audio_transcription_completed",
                    llm.InputTranscriptionCompleted(
                        item_id=ev.item_id, transcript=ev.text, is_final=ev.final, turn_started_at=started
                    ),
                )
                if ev.final:
                    # LiveKit wants the final transcript before the stop; now the stop can go.
                    self._release_stop()
                    self._turn_started_at = None
            case p.ReplyStarted():
                # A reply follows the caller's transcript; with none coming (nothing recognised), the held stop
                # must not outlive the turn.
                self._release_stop()
                self._reply_turn = ev.turn_id
            case p.ReplyDone():
                if self._reply_turn == ev.turn_id:
                    self._reply_turn = None
                self.emit("omni_reply_done", OmniReplyDone(ev.turn_id, ev.interrupted, ev.text))
                # The reply ended in function calls (a reply cut by a barge-in makes none): LiveKit runs them.
                for call in ev.tool_calls:
                    self._emit_function_call(call.call_id, call.name, call.arguments)
            case p.BargeIn():
                self._reply_turn = None
                self.emit("omni_barge_in", OmniBargeIn(ev.turn_id, ev.played_samples * 1000 // OUTPUT_RATE))
            case p.Usage():
                delta = ev.input_seconds - self._usage_seconds
                self._usage_seconds = ev.input_seconds
                self._emit_usage(delta, ev.session_id)
            case p.SessionError():
                self._emit_error(
                    llm.RealtimeError(f"engine: {ev.message}", code=ev.code), recoverable=not ev.fatal
                )
            case p.SessionClosed():
                self._release_stop()
                if not self._closing:
                    self._emit_error(
                        llm.RealtimeError(f"the engine closed the session ({ev.reason})", code=ev.reason),
                        recoverable=False,
                    )
            case _:
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("livekit-omni engine event %s", ev)

    def _hold_stop(self) -> None:
        if self._stop_timer is None:
            self._stop_timer = asyncio.get_running_loop().call_later(
                self._opts.transcript_hold_s, self._release_stop
            )

    def _release_stop(self) -> None:
        if self._stop_timer is None:
            return
        self._stop_timer.cancel()
        self._stop_timer = None
        self.emit("input_speech_stopped", llm.InputSpeechStoppedEvent(user_transcription_enabled=False))

    # --- output -----------------------------------------------------------------------------------------------
    async def _frames(self) -> AsyncGenerator[llm.DuplexAudioFrame, None]:
        """One 20 ms frame per tick, silence included, for as long as the session is open."""
        await self._open_done.wait()
        player = self._player
        if player is None:
            return  # the open failed (reported as an unrecoverable error) or the session closed first
        pacer = self._pacer
        while not self._stream_closed:
            await pacer.tick()
            if self._stream_closed:
                return
            out = player.next_frame()
            for t in out.transcripts:
                # Released with the frame in which its first sample plays: text only for audio that was produced,
                # on the same clock as the frames' start_ms.
                self.emit(
                    "transcript_delta",
                    llm.DuplexOutputTranscriptDelta(text=t.text, start_ms=t.start_ms, end_ms=t.end_ms),
                )
            # The payload is a view into the player's reused buffers; the frame keeps its own copy.
            frame = mono_pcm16_frame(
                out.payload.tobytes(), out.rate, {IN_REPLY: True} if self._reply_turn is not None else None
            )
            yield llm.DuplexAudioFrame(frame=frame, start_ms=out.start_ms)
