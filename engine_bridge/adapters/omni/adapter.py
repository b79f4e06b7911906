"""The vLLM-Omni bridge adapter: each engine session is one duplex session of a ``vllm-omni serve`` sidecar.

Speech-to-speech models (MiniCPM-o 4.5, Qwen3-Omni, PersonaPlex, Nemotron VoiceChat) run in vLLM-Omni's duplex
runtime on a GPU, which speaks only its WebSocket dialect (:mod:`.dialect`). This adapter puts our media plane in
front of it: browsers, LiveKit rooms and phones reach the model through our rings, with our epoch fence and our
playout position.

Data path, per session:

* **up** (audio thread, :meth:`OmniBridgeAdapter.on_audio`): caller PCM16 at 16 kHz from the ingress ring is
  converted to the model's input format and rate (:class:`~engine_bridge.config.OmniPreset`), cut into its
  native unit and handed to the loop thread, which base64-encodes it into ``input_audio_buffer.append``.
  Nothing here waits on the socket.
* **down** (loop thread, :class:`OmniSessionBridge`): ``response.output_audio.delta`` is decoded, resampled to the
  egress rate and queued in the session outbox tagged with **our** epoch and turn id; the audio thread moves it
  into egress as for any adapter.
* **epochs**: every reply of the model is one of our turns, started at our current epoch. Our barge-in (a client
  interrupt, which the engine core has already fenced) cuts the turn here, reports the played position
  (``playback.ack``) and sends ``barge_in``; the model's own barge-in arrives as a cancelled ``response.done``
  (its ``audio.cancelled``), and then *we* bump the epoch: the media plane drops the queued audio at its next
  frame. Audio of a cut turn that still arrives is refused by the fence.
* **playout**: while a turn plays, the media side's playout report (egress ring header) goes back every
  ``ack_interval_ms`` as ``playback.ack``, so the model's history keeps what the caller heard.
* **text**: caller transcripts become ``InputTranscript``; model transcript deltas become ``OutputTranscript``
  over the samples they accompany (the media side shows them as those samples play).
* **lifetime**: a dropped socket is resumed with the resume token; a sidecar that is gone ends the session with
  the typed error ``sidecar_lost``, like an engine crash.

Turn-taking is the model's when the preset says so (``owns_turn_taking``): the bridge runs no endpointing and
never commits, the model decides when to listen and when to speak (it may speak first). For a model that does
not own its turns, the bridge commits a turn after ``turn_taking.silence_ms`` of caller silence
(an energy gate, no VAD model). Barge-in stays available as a safety net where the model allows it: a client
interrupt always, and with ``barge_in_after_ms`` caller speech over the model for that long. Capabilities are data (:meth:`capabilities`): /health and ``session.started``
report them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import numpy as np
import soxr

from engine_bridge import protocol as p
from engine_bridge.adapters.base import AdapterCaps, ModelAdapter, SessionRefused
from engine_bridge.adapters.omni import dialect as d
from engine_bridge.adapters.omni.link import BridgeLoop, LinkRefused, OmniLink
from engine_bridge.config import EngineSettings, OmniPreset
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, ms_to_samples, samples_to_ms
from engine_bridge.reply import ReplyPhase, ReplySnapshot
from engine_bridge.session import (
    AdapterState,
    DuplexSession,
    InterruptRequest,
    MuteChange,
    SettingsChange,
    TextAppend,
)

log = logging.getLogger(__name__)

#: Model audio goes into the outbox in pieces of at most this many samples (100 ms at the egress rate).
OUT_PIECE_SAMPLES: Final = ENGINE_OUTPUT_RATE // 10
#: Energy gate for the commit of models that do not own turn-taking: a 20 ms frame above this RMS is speech.
SPEECH_RMS: Final = 500.0


@dataclass(slots=True)
class OmniTurn:
    """One model response, as one of our turns. Loop thread only."""

    response_id: str
    turn_id: int
    epoch: int
    samples: int = 0
    seq: int = 0
    #: (end sample, text) of each transcript delta: the played part of a cut turn is the text up to playout.
    words: list[tuple[int, str]] = field(default_factory=list)
    text_mark: int = 0
    generated: bool = False
    finished: bool = False
    acked_ms: int = 0
    audible: bool = False

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.words).strip()

    def text_until(self, sample: int) -> str:
        return "".join(t for end, t in self.words if end <= sample).strip()


@dataclass(slots=True)
class _Uplink:
    """Caller audio on its way up. Audio thread only."""

    resampler: soxr.ResampleStream | None
    #: The model takes our ingress format as it is (PCM16 at 16 kHz): units go up as int16, unconverted.
    passthrough: bool
    pending: np.ndarray
    unit_samples: int
    #: Energy-gated turn ends for models that do not own turn-taking.
    gate: bool
    silence_ms: int
    #: The barge-in safety net (``OmniPreset.barge_in_after_ms``; 0: off).
    barge_in_after_ms: int = 0
    voiced_ms: int = 0
    quiet_ms: int = 0
    overlap_ms: int = 0
    #: The turn the safety net already cut (one cut per turn).
    cut_turn: int = 0


@dataclass
class OmniSessionState(AdapterState):
    bridge: OmniSessionBridge
    uplink: _Uplink


class OmniBridgeAdapter(ModelAdapter):
    name = "omni_bridge"
    #: ``step`` never works (the sidecar runs the model) and every mailbox message wakes the scheduler
    #: (``DuplexSession.post``), so its idle poll is only a safety net: at 5 ms it was a fifth of the engine's CPU
    #: at 16 sessions.
    scheduler_idle_s = 0.25

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        self.omni = settings.omni_bridge
        self.preset: OmniPreset = self.omni.resolved_preset()
        self.caps = AdapterCaps(
            owns_turn_taking=self.preset.owns_turn_taking,
            resident_kv=False,  # the KV lives in the sidecar; no rollback (vLLM-Omni 0.30: capability false)
            exact_rollback=False,
            barge_in=self.preset.barge_in,
        )
        self.url = d.session_url(self.omni.url, self.omni.path, self.omni.model)
        self.loop = BridgeLoop()
        self.bridges: dict[str, OmniSessionBridge] = {}
        self.sidecar = "unknown"
        self.refused = 0
        self._ticker: asyncio.Task[None] | None = None

    # --- lifetime ------------------------------------------------------------------------------------------
    def load(self) -> None:
        """Start the loop thread and wait for the sidecar to answer ``/health`` (it loads models for minutes)."""
        self.loop.start()
        self.loop.submit(self._wait_sidecar()).result(timeout=self.omni.startup_timeout_s + 5.0)
        self.loop.call(self._start_ticker)

    def _start_ticker(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick_all(), name="omni-bridge-tick")

    async def _tick_all(self) -> None:
        """One timer for every session's periodic work (not one per session: fewer wake-ups per unit)."""
        every = self.omni.ack_interval_ms / 1000
        event_ack_every = max(1, round(self.omni.event_ack_interval_ms / self.omni.ack_interval_ms))
        ticks = 0
        while True:
            await asyncio.sleep(every)
            ticks += 1
            ack_events = ticks % event_ack_every == 0
            for bridge in list(self.bridges.values()):
                try:
                    bridge.tick(ack_events=ack_events)
                except Exception:
                    log.exception("session %s: bridge tick failed", bridge.session.id)

    async def _wait_sidecar(self) -> None:
        health = (
            self.omni.url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + "/health"
        )
        deadline = time.monotonic() + self.omni.startup_timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                async with self.loop.http().get(health) as r:
                    if r.status == 200:
                        self.sidecar = "up"
                        return
                    last = f"HTTP {r.status}"
            except Exception as e:  # connection refused while it starts
                last = str(e) or type(e).__name__
            await asyncio.sleep(0.25)
        self.sidecar = "down"
        raise RuntimeError(f"the vLLM-Omni sidecar at {self.omni.url} did not answer {health}: {last}")

    def describe(self) -> dict[str, Any]:
        pr = self.preset
        return {
            "adapter": self.name,
            "omni": {
                "url": self.omni.url,
                "path": self.omni.path,
                "model": self.omni.model,
                "preset": self.omni.preset,
                "input": {"format": pr.input_format, "rate": pr.input_rate, "unit_ms": pr.input_unit_ms},
                "output_rate": pr.output_rate,
                "max_sessions": pr.max_sessions,
                "sidecar": self.sidecar,
                "links": len(self.bridges),
                "resumes": sum(b.link.resumes for b in list(self.bridges.values()) if b.link is not None),
                "refused": self.refused,
            },
        }

    # --- sessions (scheduler thread) -----------------------------------------------------------------------
    def open(self, session: DuplexSession) -> None:
        if len(self.bridges) >= self.preset.max_sessions:
            self.refused += 1
            raise SessionRefused(
                p.ErrorCode.SESSION_LIMIT_REACHED,
                f"the model server takes {self.preset.max_sessions} sessions ({self.omni.preset}); try again later",
            )
        bridge = OmniSessionBridge(self, session)
        opening = self.loop.submit(bridge.open())
        try:
            opening.result(timeout=self.omni.handshake_timeout_s + 5.0)
        except TimeoutError as e:
            opening.cancel()
            raise SessionRefused(
                p.ErrorCode.TIMEOUT, "the model server did not open the session in time"
            ) from e
        except LinkRefused as e:
            self.refused += 1
            if e.code in d.CAPACITY_CODES:
                raise SessionRefused(
                    p.ErrorCode.SESSION_LIMIT_REACHED, f"the model server is full ({e})"
                ) from e
            raise SessionRefused(
                p.ErrorCode.INVALID_REQUEST, f"the model server refused the session ({e})"
            ) from e
        except (OSError, ConnectionError, aiohttp.ClientError) as e:
            raise SessionRefused(p.ErrorCode.ENGINE_LOADING, f"the model server is not reachable: {e}") from e
        pr = self.preset
        resampler = (
            soxr.ResampleStream(ENGINE_INPUT_RATE, pr.input_rate, 1, dtype="float32")
            if pr.input_rate != ENGINE_INPUT_RATE
            else None
        )
        silence = session.config.turn_taking.silence_ms or self.settings.turn_taking.silence_ms
        passthrough = pr.input_format == "pcm16" and pr.input_rate == ENGINE_INPUT_RATE
        session.adapter_state = OmniSessionState(
            bridge,
            _Uplink(
                resampler=resampler,
                passthrough=passthrough,
                pending=np.zeros(0, dtype=np.int16 if passthrough else np.float32),
                unit_samples=ms_to_samples(pr.input_unit_ms, pr.input_rate),
                gate=not pr.owns_turn_taking,
                silence_ms=silence,
                barge_in_after_ms=pr.barge_in_after_ms if pr.barge_in else 0,
            ),
        )
        self.bridges[session.id] = bridge

    def close(self, session: DuplexSession) -> None:
        st = session.adapter_state
        bridge = self.bridges.pop(session.id, None)
        if isinstance(st, OmniSessionState):
            bridge = st.bridge
        session.adapter_state = None
        if bridge is not None and self.loop.running:
            try:
                self.loop.submit(bridge.close()).result(timeout=3.0)
            except Exception:
                log.warning("session %s: closing its sidecar session did not finish", session.id)

    # --- audio thread --------------------------------------------------------------------------------------
    def on_audio(self, session: DuplexSession, pcm: np.ndarray) -> None:
        st = session.adapter_state
        if not isinstance(st, OmniSessionState):
            return
        up = st.uplink
        if up.gate:
            self._gate(st, pcm)
        if up.barge_in_after_ms:
            self._watch_overlap(session, st, pcm)
        if up.passthrough:
            x: np.ndarray = pcm.copy()  # ``pcm`` is the engine's read buffer, reused at the next read
        else:
            x = pcm.astype(np.float32) * (1.0 / 32768.0)
            if up.resampler is not None:
                x = up.resampler.resample_chunk(x)
        buf = np.concatenate([up.pending, x]) if up.pending.size else x
        n = up.unit_samples
        full = buf.shape[0] // n * n
        for i in range(0, full, n):
            self.loop.call(st.bridge.send_audio, buf[i : i + n])
        up.pending = buf[full:].copy() if full else buf

    def _watch_overlap(self, session: DuplexSession, st: OmniSessionState, pcm: np.ndarray) -> None:
        """The safety net: caller speech over audible model speech for ``barge_in_after_ms`` cuts the model off.
        The fence goes up here, on the audio thread, first: the media plane drops the queued audio at its next
        frame; the loop thread then tells the model (``playback.ack`` + ``barge_in``)."""
        up = st.uplink
        reply = session.reply
        if not session.model_audible() or reply.turn_id == up.cut_turn:
            up.overlap_ms = 0
            return
        frame = ENGINE_INPUT_RATE // 50
        for i in range(0, pcm.shape[0] - frame + 1, frame):
            f = pcm[i : i + frame].astype(np.float32)
            up.overlap_ms = up.overlap_ms + 20 if float(np.sqrt(np.mean(f * f))) > SPEECH_RMS else 0
            if up.overlap_ms >= up.barge_in_after_ms:
                up.overlap_ms = 0
                up.cut_turn = reply.turn_id
                epoch = session.bump_epoch()
                self.loop.call(st.bridge.local_barge_in, epoch, True)
                return

    def _gate(self, st: OmniSessionState, pcm: np.ndarray) -> None:
        """The commit of a model that does not own turn-taking: speech, then ``silence_ms`` of quiet."""
        up = st.uplink
        frame = ENGINE_INPUT_RATE // 50
        for i in range(0, pcm.shape[0] - frame + 1, frame):
            f = pcm[i : i + frame].astype(np.float32)
            if float(np.sqrt(np.mean(f * f))) > SPEECH_RMS:
                up.voiced_ms += 20
                up.quiet_ms = 0
            elif up.voiced_ms:
                up.quiet_ms += 20
                if up.quiet_ms >= up.silence_ms:
                    up.voiced_ms = up.quiet_ms = 0
                    self.loop.call(st.bridge.commit)

    # --- scheduler thread ----------------------------------------------------------------------------------
    def handle(self, session: DuplexSession, msg: Any) -> None:
        st = session.adapter_state
        if not isinstance(st, OmniSessionState):
            return
        match msg:
            case InterruptRequest():
                self.loop.call(st.bridge.local_barge_in, msg.epoch)
            case TextAppend() | MuteChange() | SettingsChange():
                # Mute zeroes the audio in the engine core; text appends are not part of the duplex audio lane; the
                # sidecar session's settings are fixed when it opens (the preset's), so a change is only recorded
                # in the session's config.
                return
            case _:
                log.warning("session %s: unexpected mailbox message %r", session.id, msg)

    def step(self, sessions: list[DuplexSession]) -> bool:
        return False  # all the model work is the sidecar's; the loop thread moves its events

    def shutdown(self) -> None:
        self.loop.stop()


class OmniSessionBridge:
    """One engine session ↔ one sidecar session: the event mapping. Loop thread only (``open``/``close`` are
    coroutines run on it; ``send_audio``/``commit``/``local_barge_in`` are called on it through the loop)."""

    def __init__(self, adapter: OmniBridgeAdapter, session: DuplexSession) -> None:
        self.adapter = adapter
        self.session = session
        self.preset = adapter.preset
        self.omni = adapter.omni
        self.link: OmniLink | None = None
        self.input_end_ms = 0
        self.turn: OmniTurn | None = None
        #: The model's current epoch (``audio.cancelled`` moves it); audio of an older one is dropped.
        self.model_epoch = 0
        #: Response ids whose audio must not play any more (cut by us or by the model).
        self.cut: set[str] = set()
        self.resampler = self._new_resampler()
        self.speech_start_ms = 0
        self.speech_end_ms = 0
        self.ended = False

    def _new_resampler(self) -> soxr.ResampleStream | None:
        rate = self.preset.output_rate
        if rate == ENGINE_OUTPUT_RATE:
            return None
        return soxr.ResampleStream(rate, ENGINE_OUTPUT_RATE, 1, dtype="int16")

    # --- lifetime ------------------------------------------------------------------------------------------
    async def open(self) -> None:
        pr = self.preset
        link = OmniLink(
            self.adapter.loop,
            self.adapter.url,
            self,
            handshake_timeout_s=self.omni.handshake_timeout_s,
            resume_window_s=self.omni.resume_window_s,
            heartbeat_s=self.omni.heartbeat_s,
        )
        payload = d.session_payload(
            model=self.omni.model,
            input_format=pr.input_format,
            input_rate=pr.input_rate,
            output_rate=pr.output_rate,
            instructions=self.session.config.instructions or self.omni.instructions,
            extra_session=pr.session,
            extra_body=pr.extra_body,
            auto_response=pr.owns_turn_taking,
        )
        self.link = link
        await link.open(payload)
        self.session.stats.extra["omni"] = {"session_id": link.session_id, "capabilities": self.model_caps()}

    def model_caps(self) -> dict[str, Any]:
        caps = self.link.session_info.get("capabilities") if self.link is not None else None
        return dict(caps) if isinstance(caps, dict) else {}

    async def close(self) -> None:
        self.ended = True
        if self.link is not None:
            await self.link.close()

    # --- up ------------------------------------------------------------------------------------------------
    def send_audio(self, unit: np.ndarray) -> None:
        link = self.link
        if link is None or self.ended:
            return
        pr = self.preset
        dur = samples_to_ms(unit.shape[0], pr.input_rate)
        self.input_end_ms += dur
        link.send(
            d.AppendAudio(
                audio=d.encode_input(unit, pr.input_format),
                format=pr.input_format,
                sample_rate_hz=pr.input_rate,
                duration_ms=dur,
                audio_end_ms=self.input_end_ms,
            )
        )

    def commit(self) -> None:
        if self.link is not None and not self.ended:
            self.link.send(d.Commit(create_response=True))

    # --- barge-in ------------------------------------------------------------------------------------------
    def local_barge_in(self, epoch: int, caller: bool = False) -> None:
        """Our side cut the model off, the epoch already bumped to ``epoch``: a client interrupt (the engine core
        fenced it) or, with ``caller``, the safety net heard the caller over the model (a ``BargeIn``)."""
        turn = self.turn
        if turn is None or turn.finished or self.link is None:
            return
        played = self._played(turn)
        self._ack(turn, played, force=True)  # first: the model's history keeps what was heard
        if self.preset.barge_in:
            self.link.send(d.BargeIn())
        else:
            self.link.send(d.CancelResponse(response_id=turn.response_id))
        self._end_turn(turn, played, barge_in_epoch=epoch if caller else None)

    def _model_barge_in(self, turn: OmniTurn) -> None:
        """The model cut itself off (its overlap policy or server VAD heard the caller): fence our output."""
        played = self._played(turn)
        epoch = self.session.bump_epoch()
        self._end_turn(turn, played, barge_in_epoch=epoch)

    def _end_turn(self, turn: OmniTurn, played: int, *, barge_in_epoch: int | None) -> None:
        s = self.session
        turn.finished = True
        self.cut.add(turn.response_id)
        self.resampler = self._new_resampler()  # its tail belongs to the cut turn
        s.stats.barge_ins += 1
        s.reply = ReplySnapshot(turn.turn_id, turn.epoch, ReplyPhase.INTERRUPTED)
        if barge_in_epoch is not None:
            s.emit(
                p.BargeIn(
                    session_id=s.id,
                    epoch=barge_in_epoch,
                    turn_id=turn.turn_id,
                    at_ms=s.input_ms,
                    played_samples=played,
                )
            )
        s.emit(
            p.ReplyDone(
                session_id=s.id,
                turn_id=turn.turn_id,
                epoch=turn.epoch,
                interrupted=True,
                text=turn.text_until(played),
                total_samples=turn.samples,
            )
        )
        s.set_state(p.SessionState.USER_SPEAKING)
        self.turn = None

    # --- down ----------------------------------------------------------------------------------------------
    def on_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        s = self.session
        if kind == "response.output_audio.delta":
            self._on_audio(ev)
        elif kind == "response.output_audio_transcript.delta":
            turn = self.turn
            text = ev.get("delta")
            if (
                turn is not None
                and turn.response_id == d.response_id_of(ev)
                and isinstance(text, str)
                and text
            ):
                turn.words.append((turn.samples, text))
                s.emit(
                    p.OutputTranscript(
                        session_id=s.id,
                        turn_id=turn.turn_id,
                        epoch=turn.epoch,
                        text=text,
                        start_sample=turn.text_mark,
                        end_sample=max(turn.samples, turn.text_mark),
                    )
                )
                turn.text_mark = turn.samples
        elif kind == "response.created":
            self._on_response_created(d.response_id_of(ev))
        elif kind == "response.done":
            self._on_response_done(ev)
        elif kind == "output_audio_buffer.cleared":
            turn = self.turn
            if turn is not None and not turn.finished and d.response_id_of(ev) in ("", turn.response_id):
                self._model_barge_in(turn)
        elif kind == "input_audio_buffer.speech_started":
            at = ev.get("audio_start_ms")
            self.speech_start_ms = int(at) if isinstance(at, int | float) else self.input_end_ms
            s.emit(p.SpeechStarted(session_id=s.id, at_ms=self.speech_start_ms))
            if self.turn is None:
                s.set_state(p.SessionState.USER_SPEAKING)
        elif kind == "input_audio_buffer.speech_stopped":
            at = ev.get("audio_end_ms")
            self.speech_end_ms = int(at) if isinstance(at, int | float) else self.input_end_ms
            s.emit(p.SpeechStopped(session_id=s.id, at_ms=self.speech_end_ms))
        elif kind == "conversation.item.input_audio_transcription.completed":
            text = ev.get("transcript")
            if isinstance(text, str) and text.strip():
                end = max(self.speech_end_ms, self.speech_start_ms)
                s.emit(
                    p.InputTranscript(
                        session_id=s.id,
                        item_id=str(ev.get("item_id") or f"item_{s.stats.turns}"),
                        text=text.strip(),
                        start_ms=self.speech_start_ms,
                        end_ms=end,
                        final=True,
                    )
                )
        elif kind == "error":
            code, message = d.error_code(ev)
            s.emit(
                p.SessionError(
                    session_id=s.id, code="sidecar_error", message=f"{code}: {message}", fatal=False
                )
            )
        elif kind in ("session.closed", "session.expired"):
            if not self.ended:
                self._lost(
                    f"the vLLM-Omni session ended on the sidecar ({kind}: {ev.get('reason') or ''})".strip()
                )

    def _on_response_created(self, response_id: str) -> None:
        s = self.session
        if not response_id or response_id in self.cut:
            return
        if self.turn is not None and not self.turn.finished:
            self._finish(self.turn)  # a new response supersedes a draining one
        s.turn_id += 1
        s.stats.turns += 1
        turn = OmniTurn(response_id=response_id, turn_id=s.turn_id, epoch=s.epoch)
        self.turn = turn
        s.reply = ReplySnapshot(turn.turn_id, turn.epoch, ReplyPhase.GENERATING)
        s.emit(p.ReplyStarted(session_id=s.id, turn_id=turn.turn_id, epoch=turn.epoch))
        s.set_state(p.SessionState.THINKING)

    def _on_audio(self, ev: dict[str, Any]) -> None:
        rid = d.response_id_of(ev)
        turn = self.turn
        if turn is None or rid != turn.response_id or turn.finished or rid in self.cut:
            return  # stale: a cut (or unknown) response; the fence would refuse it anyway
        ep = d.event_epoch(ev)
        if ep is not None and ep < self.model_epoch:
            return
        delta = ev.get("delta")
        if not isinstance(delta, str) or not delta:
            return
        pcm = d.decode_output(delta)
        rate = ev.get("sample_rate_hz")
        if self.resampler is not None:
            pcm = self.resampler.resample_chunk(pcm)
        elif isinstance(rate, int) and rate not in (0, ENGINE_OUTPUT_RATE):
            pcm = soxr.resample(pcm, rate, ENGINE_OUTPUT_RATE)
        self._write(turn, pcm)

    def _write(self, turn: OmniTurn, pcm: np.ndarray) -> None:
        s = self.session
        for i in range(0, pcm.shape[0], OUT_PIECE_SAMPLES):
            piece = pcm[i : i + OUT_PIECE_SAMPLES]
            if not s.write_audio(turn.epoch, turn.turn_id, turn.seq, piece):
                return  # the fence went up under us
            turn.seq += 1
            turn.samples += piece.shape[0]
        if not turn.audible and turn.samples:
            turn.audible = True
            s.reply = ReplySnapshot(turn.turn_id, turn.epoch, ReplyPhase.VOICING)
            s.set_state(p.SessionState.SPEAKING)

    def _on_response_done(self, ev: dict[str, Any]) -> None:
        resp = ev.get("response")
        status = resp.get("status") if isinstance(resp, dict) else None
        meta = resp.get("metadata") if isinstance(resp, dict) else None
        if (
            isinstance(meta, dict)
            and meta.get("type") == "audio.cancelled"
            and isinstance(meta.get("epoch"), int)
        ):
            self.model_epoch = max(self.model_epoch, int(meta["epoch"]))
        rid = d.response_id_of(ev)
        turn = self.turn
        if turn is None or turn.response_id != rid or turn.finished:
            return  # our own cut, already handled (its epoch mapping is recorded above)
        if status == "cancelled":
            self._model_barge_in(turn)
            return
        if self.resampler is not None:
            # The resampler holds the last few milliseconds back until it is told the stream ended: flush them into
            # this turn, or they would play at the head of the next reply (and this one's end be acked short).
            self._write(turn, self.resampler.resample_chunk(np.zeros(0, dtype=np.int16), last=True))
            self.resampler = self._new_resampler()
        turn.generated = True
        self.session.reply = ReplySnapshot(turn.turn_id, turn.epoch, ReplyPhase.DRAINING)

    def _finish(self, turn: OmniTurn) -> None:
        s = self.session
        turn.finished = True
        self._ack(turn, turn.samples, force=True)
        s.reply = ReplySnapshot(turn.turn_id, turn.epoch, ReplyPhase.DONE)
        s.emit(
            p.ReplyDone(
                session_id=s.id,
                turn_id=turn.turn_id,
                epoch=turn.epoch,
                interrupted=False,
                text=turn.text,
                total_samples=turn.samples,
            )
        )
        if self.turn is turn:
            self.turn = None
        s.set_state(p.SessionState.LISTENING)

    # --- playout -------------------------------------------------------------------------------------------
    def _played(self, turn: OmniTurn) -> int:
        """Samples of ``turn`` that left the server: the media side's report, else what reached egress."""
        epoch, turn_id, played = self.session.rings.egress.playout()
        if turn_id == turn.turn_id and epoch == turn.epoch:
            return min(played, turn.samples)
        w = self.session.written
        return w.samples if w.turn_id == turn.turn_id else 0

    def _ack(self, turn: OmniTurn, played: int, *, force: bool = False) -> None:
        ms = samples_to_ms(played, ENGINE_OUTPUT_RATE)
        if self.link is None or (ms <= turn.acked_ms and not force):
            return
        turn.acked_ms = max(turn.acked_ms, ms)
        self.link.send(d.AckPlayback(played_ms=ms, committed_ms=ms, response_id=turn.response_id))

    def tick(self, *, ack_events: bool = True) -> None:
        """Every ``ack_interval_ms`` (the adapter's one ticker for all sessions): the playout goes back as
        ``playback.ack``, a generated turn whose audio has all left is done; with ``ack_events`` (every
        ``event_ack_interval_ms``) the newest event is acknowledged."""
        if self.ended or self.link is None:
            return
        if ack_events:
            self.link.flush_event_ack()
        turn = self.turn
        if turn is None or turn.finished:
            return
        self._ack(turn, self._played(turn))
        if turn.generated:
            eg = self.session.rings.egress
            if not self.session.outbox and eg.write_cursor <= eg.read_cursor:
                self._finish(turn)

    # --- loss ----------------------------------------------------------------------------------------------
    def on_lost(self, reason: str) -> None:
        self._lost(reason)

    def _lost(self, message: str) -> None:
        if self.ended:
            return
        self.ended = True
        s = self.session
        log.warning("session %s: %s", s.id, message)
        s.emit(p.SessionError(session_id=s.id, code="sidecar_lost", message=message, fatal=True))
        end = self.adapter.end_session
        if end is not None:
            end(s, p.CloseReason.SIDECAR_LOST)
