"""The cascade adapter: turn-taking (VAD) → ASR → thinker with a KV lease → clause-by-clause TTS.

Where the time goes, and how the stages overlap (docs/speech-stack.md, One turn, puts the naive sum at 1.3-2 s):

1. While the caller talks, the audio thread runs the VAD on every frame (microseconds).
2. After ``speculative_ms`` of silence (default 200 ms, well before the 500 ms endpoint) the turn's audio goes to
   the ASR worker *speculatively*; when the transcript comes back the thinker appends it to the session's KV and
   starts the reply, and the TTS worker voices the first clause. Audio produced before the endpoint is *held*.
3. At the endpoint (``silence_ms``) the speculation is confirmed and the held audio is released at once. If the
   caller speaks again first, the speculation is thrown away: the thinker rolls back to the checkpoint taken
   before the user text (exact, the KV is cropped), held audio is dropped, and the longer turn is transcribed
   at its real endpoint.

Barge-in: the audio thread bumps the epoch word in the egress ring header the moment the caller has spoken
``barge_in_min_ms`` over model speech; the scheduler then aborts generation at its next step, TTS output of the
old epoch is refused by the fence, and the thinker keeps only what was played (playout position reported by the
media side in the ring header; until then, what was written to egress).

Threads: ``on_audio`` (audio thread) is cheap: VAD + fence. ASR and TTS run on one worker thread each (their
libraries release the GIL), the thinker runs on the scheduler thread, which owns every session's conversation.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from engine_bridge import protocol as p
from engine_bridge.adapters.base import AdapterCaps, ModelAdapter
from engine_bridge.config import EngineSettings
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, samples_to_ms
from engine_bridge.session import (
    DuplexSession,
    InterruptRequest,
    MuteChange,
    Role,
    Segment,
    TextAppend,
)
from engine_bridge.speech.asr import Transcriber, Transcript, make_transcriber
from engine_bridge.speech.text import ClauseSplitter, clean_for_tts
from engine_bridge.speech.tts import OutputResampler, Synthesizer, make_synthesizer
from engine_bridge.speech.vad import SpeechStarted, SpeechStopped, TurnDetector, VADEngine, VADSettings
from engine_bridge.thinker.base import Message, ThinkerBackend

log = logging.getLogger(__name__)

#: Per-turn timing records kept per session (for stats and the voice-to-voice benchmark).
TURN_RECORDS: Final = 64
USAGE_EVERY_S: Final = 5.0
COMMENTARY_PROMPT: Final = "Say the following to the caller now, briefly and in your own words: "
SPEAK_NOW_PROMPT: Final = "Speak to the caller now, briefly, without waiting for them to speak first."


# --- mailbox messages from the audio thread and the workers -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _VadStart:
    start_ms: int
    at_ms: int


@dataclass(frozen=True, slots=True)
class _Speculate:
    audio: np.ndarray
    start_ms: int
    end_ms: int
    at_wall: float


@dataclass(frozen=True, slots=True)
class _Resumed:
    at_ms: int


@dataclass(frozen=True, slots=True)
class _Endpoint:
    ev: SpeechStopped
    at_wall: float
    #: True when the model was speaking and the caller's speech stayed under the barge-in minimum.
    backchannel: bool


@dataclass(frozen=True, slots=True)
class _BargeIn:
    epoch: int
    at_ms: int
    at_wall: float


@dataclass(frozen=True, slots=True)
class _AsrDone:
    job: int
    transcript: Transcript
    elapsed_ms: float


@dataclass(frozen=True, slots=True)
class _TtsDone:
    turn_id: int
    epoch: int


# --- per-session state -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Word:
    text: str
    start_sample: int
    end_sample: int


@dataclass(slots=True)
class _Reply:
    """One assistant reply. Generation fields belong to the scheduler; ``samples``/``words``/``held`` are written
    by the TTS worker under ``lock`` and read by the scheduler at barge-in."""

    turn_id: int
    epoch: int
    ckpt_log_len: int
    user_ckpt_log_len: int | None
    confirmed: bool
    started_wall: float
    splitter: ClauseSplitter = field(default_factory=ClauseSplitter)
    generating: bool = True
    clauses_sent: int = 0
    clauses_done: int = 0
    text: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    samples: int = 0
    seq: int = 0
    words: list[_Word] = field(default_factory=list)
    held: list[tuple[np.ndarray, list[p.OutputTranscript]]] = field(default_factory=list)
    resampler: OutputResampler | None = None
    first_clause_wall: float | None = None
    first_audio_wall: float | None = None
    cancelled: bool = False
    #: How the caller's message went into the KV: {user_tokens, prefill_tokens, cached_tokens, log_before}.
    append_stats: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Turn:
    """The caller turn being transcribed (speculatively or at its endpoint)."""

    job: int
    start_ms: int
    end_ms: int
    speculative: bool
    confirmed: bool
    at_wall: float
    endpoint_wall: float | None = None
    transcript: Transcript | None = None
    asr_ms: float = 0.0


@dataclass(slots=True)
class _CascadeState:
    detector: TurnDetector
    barge_in_min_ms: int
    speculative_ms: int
    # audio thread
    spec_posted: bool = False
    barged_this_turn: bool = False
    speech_while_speaking: bool = False
    # scheduler thread
    turn: _Turn | None = None
    reply: _Reply | None = None
    pending_context: list[tuple[str, str]] = field(default_factory=list)
    want_reply: bool = False
    turn_records: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=TURN_RECORDS)
    )
    last_usage: float = field(default_factory=time.monotonic)
    item_seq: int = 0


def make_thinker(settings: EngineSettings) -> ThinkerBackend:
    """The transformers thinker configured from the engine settings (a vLLM backend would plug in here)."""
    from engine_bridge.thinker.model_store import DEFAULT_MODEL
    from engine_bridge.thinker.prompting import DEFAULT_SYSTEM_PROMPT, SPOKEN_DECODING
    from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

    m = settings.models
    cfg = TorchThinkerConfig(
        model=DEFAULT_MODEL if m.thinker == "smollm2" else m.thinker,
        dtype=m.thinker_dtype,
        threads=settings.threads,
        max_context_tokens=m.max_context_tokens,
        max_sessions=settings.max_sessions,
        system_prompt=m.system_prompt or DEFAULT_SYSTEM_PROMPT,
        decoding=dataclasses.replace(SPOKEN_DECODING, max_tokens=m.max_reply_tokens),
        cache_dir=str(settings.cache_dir / "models"),
    )
    return TorchThinker(cfg)


class CascadeAdapter(ModelAdapter):
    name = "cascade"
    caps = AdapterCaps(owns_turn_taking=False, resident_kv=True, exact_rollback=True)

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        self.asr: Transcriber | None = None
        self.tts: Synthesizer | None = None
        self.thinker: ThinkerBackend | None = None
        self._asr_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-asr")
        self._tts_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-tts")
        self._jobs = 0
        self._jobs_lock = threading.Lock()
        self._kv_bytes = 0
        self._thinker_sessions = 0

    # --- lifecycle -----------------------------------------------------------------------------------------
    def load(self) -> None:
        m = self.settings.models
        t0 = time.monotonic()
        self.thinker = make_thinker(self.settings)
        t1 = time.monotonic()
        self.asr = make_transcriber(m.asr, threads=self.settings.threads)
        self.asr.warmup()
        t2 = time.monotonic()
        self.tts = make_synthesizer(m.tts, threads=self.settings.threads)
        self.tts.warmup()
        log.info(
            "cascade loaded: thinker %s %.1f s, asr %s %.1f s, tts %s %.1f s",
            m.thinker,
            t1 - t0,
            m.asr,
            t2 - t1,
            m.tts,
            time.monotonic() - t2,
        )

    def describe(self) -> dict[str, Any]:
        m = self.settings.models
        return {
            "adapter": self.name,
            "models": {"asr": m.asr, "thinker": m.thinker, "tts": m.tts},
            # Refreshed by the scheduler on open/close: the thinker is not safe to query from other threads.
            "kv_bytes": self._kv_bytes,
            "thinker_sessions": self._thinker_sessions,
        }

    def _refresh_kv(self) -> None:
        if self.thinker is not None:
            self._kv_bytes = self.thinker.memory_bytes()
            self._thinker_sessions = len(self.thinker.session_ids())

    def _vad_settings(self, session: DuplexSession) -> tuple[VADSettings, int, int]:
        tt = self.settings.turn_taking
        o = session.config.turn_taking
        engine = o.vad or tt.vad
        vs = VADSettings(
            engine=VADEngine(engine),
            aggressiveness=o.aggressiveness if o.aggressiveness is not None else tt.aggressiveness,
            threshold=o.threshold if o.threshold is not None else tt.threshold,
            prefix_padding_ms=o.prefix_padding_ms
            if o.prefix_padding_ms is not None
            else tt.prefix_padding_ms,
            silence_ms=o.silence_ms if o.silence_ms is not None else tt.silence_ms,
        )
        barge = o.barge_in_min_ms if o.barge_in_min_ms is not None else tt.barge_in_min_ms
        return vs, barge, min(tt.speculative_ms, vs.silence_ms)

    def open(self, session: DuplexSession) -> None:
        assert self.thinker is not None
        vs, barge, spec = self._vad_settings(session)
        history = [Message(role=t.role, text=t.text) for t in session.config.history]
        self.thinker.open(session.id, session.config.instructions or None, history or None)
        session.adapter_state = _CascadeState(TurnDetector(vs), barge, spec)
        self._refresh_kv()
        # The conversation log mirrors the thinker's token log: system prompt, then the startup history.
        for seg in self.thinker.log(session.id).segments:
            session.log.append(
                Segment(Role(seg.role), seg.text, session.epoch, token_start=seg.start, token_end=seg.end)
            )

    def close(self, session: DuplexSession) -> None:
        st: _CascadeState | None = session.adapter_state
        if st is not None and st.reply is not None:
            st.reply.cancelled = True  # TTS work still queued for this session stops at its next chunk
        if self.thinker is not None:
            self.thinker.close(session.id)
        self._refresh_kv()

    # --- audio thread ----------------------------------------------------------------------------------------
    def on_audio(self, session: DuplexSession, pcm: np.ndarray) -> None:
        st: _CascadeState | None = session.adapter_state
        if st is None:
            return
        det = st.detector
        posted: list[Any] = []
        for ev in det.push(pcm):
            if isinstance(ev, SpeechStarted):
                st.spec_posted = False
                st.barged_this_turn = False
                st.speech_while_speaking = self._model_audible(session)
                posted.append(_VadStart(ev.start_ms, ev.at_ms))
            else:
                backchannel = st.speech_while_speaking and not st.barged_this_turn
                posted.append(_Endpoint(ev, time.monotonic(), backchannel))
                st.spec_posted = False
        if det.in_speech:
            if st.spec_posted and det.silence_ms_so_far == 0:
                st.spec_posted = False
                posted.append(_Resumed(det.position_ms))
            elif (
                not st.spec_posted
                and st.speculative_ms > 0
                and det.silence_ms_so_far >= st.speculative_ms
                and not (st.speech_while_speaking and not st.barged_this_turn)
            ):
                st.spec_posted = True
                start = det.turn_start_ms or 0
                posted.append(
                    _Speculate(
                        det.utterance(), start, det.position_ms - det.silence_ms_so_far, time.monotonic()
                    )
                )
            if (
                not st.barged_this_turn
                and det.speech_ms >= st.barge_in_min_ms
                and (st.speech_while_speaking or self._model_audible(session))
            ):
                # The fence goes up *first*: the media plane drops queued stale audio at its next frame.
                st.barged_this_turn = True
                epoch = session.bump_epoch()
                posted.append(_BargeIn(epoch, det.position_ms, time.monotonic()))
        for msg in posted:
            session.post(msg)
        if posted and self.wake is not None:
            self.wake.set()

    @staticmethod
    def _model_audible(session: DuplexSession) -> bool:
        """Model speech is queued, in the ring, or still being produced."""
        if not session.reply_active:
            return False
        eg = session.rings.egress
        return bool(session.outbox) or eg.write_cursor > eg.read_cursor or session.reply_producing

    # --- scheduler thread: mailbox ----------------------------------------------------------------------------
    def handle(self, session: DuplexSession, msg: Any) -> None:
        st: _CascadeState = session.adapter_state
        match msg:
            case _VadStart():
                session.emit(p.SpeechStarted(session_id=session.id, at_ms=msg.start_ms))
                if st.reply is None:
                    session.set_state(p.SessionState.USER_SPEAKING)
            case _Speculate():
                if st.reply is None or st.reply.cancelled:
                    self._submit_asr(
                        session, st, msg.audio, msg.start_ms, msg.end_ms, speculative=True, at=msg.at_wall
                    )
            case _Resumed():
                self._discard_speculation(session, st)
            case _Endpoint():
                self._on_endpoint(session, st, msg)
            case _BargeIn():
                self._on_barge_in(session, st, msg.epoch, msg.at_ms, msg.at_wall)
            case _AsrDone():
                self._on_asr(session, st, msg)
            case _TtsDone():
                r = st.reply
                if r is not None and r.turn_id == msg.turn_id and r.epoch == msg.epoch:
                    r.clauses_done += 1
            case TextAppend():
                self._on_text(session, st, msg)
            case InterruptRequest():
                # The engine core already bumped the epoch; end the reply as a barge-in would, keeping what played.
                if st.reply is not None:
                    self._on_barge_in(session, st, msg.epoch, session.input_ms, time.monotonic(), emit=False)
            case MuteChange():
                if msg.muted:
                    st.detector.reset()
            case _:
                log.warning("session %s: unexpected mailbox message %r", session.id, msg)

    def _next_job(self) -> int:
        with self._jobs_lock:
            self._jobs += 1
            return self._jobs

    def _submit_asr(
        self,
        session: DuplexSession,
        st: _CascadeState,
        audio: np.ndarray,
        start_ms: int,
        end_ms: int,
        *,
        speculative: bool,
        at: float,
    ) -> None:
        job = self._next_job()
        st.turn = _Turn(job, start_ms, end_ms, speculative, confirmed=not speculative, at_wall=at)
        if not speculative:
            st.turn.endpoint_wall = at
        asr = self.asr
        assert asr is not None

        def run() -> None:
            t0 = time.monotonic()
            try:
                tr = asr.transcribe(audio)
            except Exception:
                log.exception("session %s: ASR failed", session.id)
                tr = Transcript(text="")
            session.post(_AsrDone(job, tr, (time.monotonic() - t0) * 1000))
            if self.wake is not None:
                self.wake.set()

        self._asr_pool.submit(run)

    def _discard_speculation(self, session: DuplexSession, st: _CascadeState) -> None:
        turn = st.turn
        if turn is None or not turn.speculative or turn.confirmed:
            return
        st.turn = None
        r = st.reply
        if r is not None and not r.confirmed:
            # Undo the speculative user message and reply: crop the KV back to before the user text.
            assert self.thinker is not None
            self._cancel_reply(session, st, r)
            if r.user_ckpt_log_len is not None:
                self.thinker.rollback(session.id, r.user_ckpt_log_len)
            st.reply = None
            session.stats.extra["speculations_discarded"] = (
                session.stats.extra.get("speculations_discarded", 0) + 1
            )

    def _on_endpoint(self, session: DuplexSession, st: _CascadeState, msg: _Endpoint) -> None:
        ev = msg.ev
        session.emit(p.SpeechStopped(session_id=session.id, at_ms=ev.end_ms))
        if msg.backchannel:
            session.stats.ignored_short_speech += 1
            self._discard_speculation(session, st)
            return
        turn = st.turn
        if turn is not None and turn.speculative and not turn.confirmed and turn.start_ms == ev.start_ms:
            turn.confirmed = True
            turn.end_ms = ev.end_ms
            turn.endpoint_wall = msg.at_wall
            if turn.transcript is not None:
                self._emit_input(session, st, turn)
            r = st.reply
            if r is not None and not r.confirmed:
                self._confirm_reply(session, r)
        else:
            self._discard_speculation(session, st)
            self._submit_asr(session, st, ev.audio, ev.start_ms, ev.end_ms, speculative=False, at=msg.at_wall)
        if st.reply is None:
            session.set_state(p.SessionState.THINKING)

    def _emit_input(self, session: DuplexSession, st: _CascadeState, turn: _Turn) -> None:
        assert turn.transcript is not None
        st.item_seq += 1
        text = turn.transcript.text.strip()
        session.emit(
            p.InputTranscript(
                session_id=session.id,
                item_id=f"item_{session.id[-8:]}_{st.item_seq}",
                text=text,
                start_ms=turn.start_ms,
                end_ms=max(turn.end_ms, turn.start_ms),
                final=True,
            )
        )

    def _on_asr(self, session: DuplexSession, st: _CascadeState, msg: _AsrDone) -> None:
        turn = st.turn
        if turn is None or turn.job != msg.job:
            return  # a discarded speculation
        turn.transcript = msg.transcript
        turn.asr_ms = msg.elapsed_ms
        text = msg.transcript.text.strip()
        if not text:
            st.turn = None
            if turn.confirmed and st.reply is None:
                session.set_state(p.SessionState.LISTENING)
            return
        if turn.confirmed:
            self._emit_input(session, st, turn)
        if st.reply is not None:
            # A reply is still running (commentary, or the caller's short turn during speech): just log the
            # caller's words once the reply ends.
            st.pending_context.append(("user", text))
            return
        self._start_reply(session, st, user_text=text, turn=turn)

    # --- replies ---------------------------------------------------------------------------------------------
    def _start_reply(
        self, session: DuplexSession, st: _CascadeState, *, user_text: str | None, turn: _Turn | None
    ) -> None:
        thinker = self.thinker
        assert thinker is not None
        self._flush_context(session, st)
        user_ckpt = None
        if user_text is not None:
            user_ckpt = len(thinker.log(session.id))
            # Deferred prefill: the caller's words, the reply header and the first token go through the model in
            # one forward pass (the first step), one pass fewer before the first word of the answer.
            res = thinker.append(session.id, "user", user_text, epoch=session.epoch, prefill=False)
            session.log.append(
                Segment(
                    Role.USER,
                    user_text,
                    session.epoch,
                    audio_start_ms=turn.start_ms if turn else 0,
                    audio_end_ms=turn.end_ms if turn else 0,
                    token_start=user_ckpt,
                    token_end=res.log_len,
                )
            )
        append_stats: dict[str, int] = {}
        if user_text is not None:
            append_stats = {
                "user_tokens": res.new_tokens,
                "prefill_tokens": res.prefill_tokens,
                "cached_tokens": res.cached_tokens,
                "log_before": user_ckpt or 0,
                "trimmed": int(res.trimmed),
            }
        ckpt = thinker.begin_reply(session.id, epoch=session.epoch)
        session.turn_id += 1
        session.stats.turns += 1
        confirmed = turn is None or turn.confirmed
        r = _Reply(
            turn_id=session.turn_id,
            epoch=session.epoch,
            ckpt_log_len=ckpt.log_len,
            user_ckpt_log_len=user_ckpt,
            confirmed=confirmed,
            started_wall=time.monotonic(),
            append_stats=append_stats,
        )
        r.resampler = OutputResampler(
            self.tts.sample_rate if self.tts else ENGINE_OUTPUT_RATE, ENGINE_OUTPUT_RATE
        )
        st.reply = r
        session.reply_turn = r.turn_id
        # A speculative reply is not audible: the caller resuming speech discards it, it is no barge-in.
        session.reply_active = confirmed
        session.reply_producing = confirmed
        if confirmed:
            session.emit(p.ReplyStarted(session_id=session.id, turn_id=r.turn_id, epoch=r.epoch))
            session.set_state(p.SessionState.THINKING)

    def _confirm_reply(self, session: DuplexSession, r: _Reply) -> None:
        r.confirmed = True
        session.reply_active = True
        session.reply_producing = r.generating or r.clauses_done < r.clauses_sent
        session.emit(p.ReplyStarted(session_id=session.id, turn_id=r.turn_id, epoch=r.epoch))
        with r.lock:
            held, r.held = r.held, []
        for pcm, transcripts in held:
            self._release_audio(session, r, pcm, transcripts)
        session.set_state(p.SessionState.SPEAKING if r.samples else p.SessionState.THINKING)

    def _release_audio(
        self, session: DuplexSession, r: _Reply, pcm: np.ndarray, transcripts: list[p.OutputTranscript]
    ) -> None:
        with r.lock:
            seq = r.seq
            r.seq += 1
        if session.queue_audio(r.epoch, r.turn_id, seq, pcm):
            if r.first_audio_wall is None:
                r.first_audio_wall = time.monotonic()
            for t in transcripts:
                session.emit(t)

    def _cancel_reply(self, session: DuplexSession, st: _CascadeState, r: _Reply) -> None:
        r.cancelled = True
        with r.lock:
            r.held.clear()
        if r.generating and self.thinker is not None and self.thinker.is_generating(session.id):
            self.thinker.rollback(session.id, r.ckpt_log_len)
        r.generating = False
        session.reply_active = False
        session.reply_producing = False

    def _on_barge_in(
        self,
        session: DuplexSession,
        st: _CascadeState,
        epoch: int,
        at_ms: int,
        at_wall: float,
        *,
        emit: bool = True,
    ) -> None:
        r = st.reply
        thinker = self.thinker
        assert thinker is not None
        session.epoch = max(session.epoch, epoch)
        if r is None:
            return
        played = self._played_samples(session, r)
        with r.lock:
            words = [w for w in r.words if w.end_sample <= played]
            r.held.clear()
        committed = " ".join(w.text for w in words).strip()
        r.cancelled = True
        if r.confirmed:
            if thinker.is_generating(session.id):
                thinker.end_reply(session.id, committed)
            else:
                thinker.rollback(session.id, r.ckpt_log_len)
                if committed:
                    thinker.append(session.id, "assistant", committed, epoch=r.epoch)
            log_len = len(thinker.log(session.id))
            if committed or r.samples:
                session.log.append(
                    Segment(
                        Role.ASSISTANT,
                        committed,
                        r.epoch,
                        turn_id=r.turn_id,
                        audio_start_ms=0,
                        audio_end_ms=samples_to_ms(played, ENGINE_OUTPUT_RATE),
                        token_start=r.ckpt_log_len,
                        token_end=log_len,
                        interrupted=True,
                    )
                )
            session.stats.barge_ins += 1
            if emit:
                session.emit(
                    p.BargeIn(
                        session_id=session.id,
                        epoch=epoch,
                        turn_id=r.turn_id,
                        at_ms=at_ms,
                        played_samples=played,
                    )
                )
            session.emit(
                p.ReplyDone(
                    session_id=session.id,
                    turn_id=r.turn_id,
                    epoch=r.epoch,
                    interrupted=True,
                    text=committed,
                    total_samples=r.samples,
                )
            )
        else:
            # Speculative and unheard: undo it entirely (including the speculative user text).
            if thinker.is_generating(session.id):
                thinker.rollback(session.id, r.ckpt_log_len)
            if r.user_ckpt_log_len is not None:
                thinker.rollback(session.id, r.user_ckpt_log_len)
            st.turn = None
        st.reply = None
        session.reply_active = False
        session.reply_producing = False
        session.stats.extra["last_barge_in_ms"] = round((time.monotonic() - at_wall) * 1000, 1)
        session.set_state(p.SessionState.USER_SPEAKING)

    @staticmethod
    def _played_samples(session: DuplexSession, r: _Reply) -> int:
        """Samples of reply ``r`` that left the server: the media side's playout report for this turn, or,
        when it has not reported any, what was written to egress."""
        epoch, turn_id, played = session.rings.egress.playout()
        if turn_id == r.turn_id and epoch == r.epoch:
            return played
        if session.written_turn_id == r.turn_id:
            return session.written_turn_samples
        return 0

    def _flush_context(self, session: DuplexSession, st: _CascadeState) -> None:
        thinker = self.thinker
        assert thinker is not None
        for role, text in st.pending_context:
            thinker.append(session.id, role, text, epoch=session.epoch)  # type: ignore[arg-type]
            session.log.append(Segment(Role(role), text, session.epoch))
        st.pending_context.clear()

    def _on_text(self, session: DuplexSession, st: _CascadeState, msg: TextAppend) -> None:
        if msg.kind in ("instructions", "thinking"):
            if msg.text:
                st.pending_context.append(("developer", msg.text))
        else:
            prompt = COMMENTARY_PROMPT + msg.text if msg.text else SPEAK_NOW_PROMPT
            st.pending_context.append(("developer", prompt))
            st.want_reply = True
        if st.reply is None:
            self._flush_context(session, st)
            if st.want_reply:
                st.want_reply = False
                self._start_reply(session, st, user_text=None, turn=None)

    # --- scheduler thread: model work ---------------------------------------------------------------------------
    def step(self, sessions: list[DuplexSession]) -> bool:
        thinker = self.thinker
        assert thinker is not None
        now = time.monotonic()
        generating: list[DuplexSession] = []
        worked = False
        for s in sessions:
            st: _CascadeState = s.adapter_state
            r = st.reply
            if r is not None and r.generating:
                generating.append(s)
            elif r is not None:
                worked |= self._maybe_finish(s, st, r)
            if now - st.last_usage >= USAGE_EVERY_S:
                st.last_usage = now
                self._emit_usage(s)
        if generating:
            outs = thinker.step([s.id for s in generating])
            for s in generating:
                self._on_token(s, s.adapter_state, outs[s.id])
            worked = True
        return worked

    def _on_token(self, session: DuplexSession, st: _CascadeState, out: Any) -> None:
        r = st.reply
        assert r is not None
        clauses: list[str] = []
        first_cut = self.settings.turn_taking.first_clause_words
        if (
            first_cut
            and r.clauses_sent == 0
            and out.text[:1].isspace()
            and len(r.splitter.pending_text.split()) >= first_cut
        ):
            # Voice the first words now instead of waiting for the end of the sentence: the caller hears the
            # answer start a few tokens earlier, at the cost of a small prosody break after them.
            clauses += r.splitter.flush()
        if out.text:
            clauses += r.splitter.push(out.text)
        if out.text:
            r.text += out.text
        if out.done:
            clauses += r.splitter.flush()
            r.generating = False
            assert self.thinker is not None
            self.thinker.end_reply(session.id, None)
        for clause in clauses:
            self._speak(session, r, clause)
        if out.done and r.clauses_sent == 0:
            # Nothing speakable came out; the reply is over.
            self._speak(session, r, "")

    def _speak(self, session: DuplexSession, r: _Reply, clause: str) -> None:
        text = clean_for_tts(clause).strip()
        if r.first_clause_wall is None and text:
            r.first_clause_wall = time.monotonic()
        r.clauses_sent += 1
        tts = self.tts
        assert tts is not None

        def run() -> None:
            try:
                if text and not r.cancelled:
                    self._synthesize(session, r, tts, text)
            except Exception:
                log.exception("session %s: TTS failed for %r", session.id, text)
            finally:
                session.post(_TtsDone(r.turn_id, r.epoch))
                if self.wake is not None:
                    self.wake.set()

        self._tts_pool.submit(run)

    def _synthesize(self, session: DuplexSession, r: _Reply, tts: Synthesizer, text: str) -> None:
        """TTS worker: voice one clause, queue its audio (or hold it while speculative) with word-level
        transcripts placed on the reply's sample timeline."""
        chunks: list[np.ndarray] = []
        assert r.resampler is not None
        for chunk in tts.synthesize(text):
            if r.cancelled:
                return
            out = r.resampler.process(chunk)
            if out.size:
                chunks.append(out)
        tail = r.resampler.flush()
        if tail.size:
            chunks.append(tail)
        if not chunks or r.cancelled:
            return
        pcm = np.concatenate(chunks)
        words = text.split()
        with r.lock:
            start = r.samples
            r.samples += pcm.shape[0]
            # Spread the clause's words over its audio in proportion to their length: Piper gives no word times.
            weights = np.array([len(w) + 1 for w in words], dtype=np.float64)
            bounds = start + np.round(
                np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum() * pcm.shape[0]
            ).astype(int)
            transcripts = []
            for i, w in enumerate(words):
                wd = _Word(w, int(bounds[i]), int(bounds[i + 1]))
                r.words.append(wd)
                transcripts.append(
                    p.OutputTranscript(
                        session_id=session.id,
                        turn_id=r.turn_id,
                        epoch=r.epoch,
                        text=w + " ",
                        start_sample=wd.start_sample,
                        end_sample=wd.end_sample,
                    )
                )
            if not r.confirmed:
                r.held.append((pcm, transcripts))
                return
        # Queue in 100 ms pieces so a barge-in fence drops the rest of a long clause cleanly.
        step = ENGINE_OUTPUT_RATE // 10
        for i in range(0, pcm.shape[0], step):
            piece = pcm[i : i + step]
            due = [t for t in transcripts if start + i <= t.start_sample < start + i + piece.shape[0]]
            self._release_audio(session, r, piece, due)
        if session.state is not p.SessionState.SPEAKING and r.confirmed and not r.cancelled:
            session.set_state(p.SessionState.SPEAKING)

    def _maybe_finish(self, session: DuplexSession, st: _CascadeState, r: _Reply) -> bool:
        """Generation is over; when all clauses are voiced and the audio has left, close the reply."""
        if r.clauses_done < r.clauses_sent or not r.confirmed:
            return False
        session.reply_producing = False
        eg = session.rings.egress
        if session.outbox or eg.write_cursor > eg.read_cursor:
            return False
        st.reply = None
        session.reply_active = False
        log_len = len(self.thinker.log(session.id)) if self.thinker else 0
        session.log.append(
            Segment(
                Role.ASSISTANT,
                r.text.strip(),
                r.epoch,
                turn_id=r.turn_id,
                audio_end_ms=samples_to_ms(r.samples, ENGINE_OUTPUT_RATE),
                token_start=r.ckpt_log_len,
                token_end=log_len,
            )
        )
        session.emit(
            p.ReplyDone(
                session_id=session.id,
                turn_id=r.turn_id,
                epoch=r.epoch,
                interrupted=False,
                text=r.text.strip(),
                total_samples=r.samples,
            )
        )
        self._record_turn(session, st, r)
        self._flush_context(session, st)
        if st.want_reply:
            st.want_reply = False
            self._start_reply(session, st, user_text=None, turn=None)
        else:
            session.set_state(
                p.SessionState.USER_SPEAKING if st.detector.in_speech else p.SessionState.LISTENING
            )
        return True

    def _record_turn(self, session: DuplexSession, st: _CascadeState, r: _Reply) -> None:
        turn = st.turn
        rec: dict[str, Any] = {
            "turn_id": r.turn_id,
            "samples": r.samples,
            "text": r.text.strip(),
            **r.append_stats,
        }
        if turn is not None and turn.endpoint_wall is not None and r.first_audio_wall is not None:
            rec.update(
                {
                    "speech_end_ms": turn.end_ms,
                    "speculative": turn.speculative,
                    "asr_ms": round(turn.asr_ms, 1),
                    "endpoint_to_first_audio_ms": round((r.first_audio_wall - turn.endpoint_wall) * 1000, 1),
                    "asr_start_to_first_clause_ms": round(
                        ((r.first_clause_wall or r.started_wall) - turn.at_wall) * 1000, 1
                    ),
                    "reply_start_to_first_clause_ms": round(
                        ((r.first_clause_wall or r.started_wall) - r.started_wall) * 1000, 1
                    ),
                    "tts_first_chunk_ms": round(
                        (r.first_audio_wall - (r.first_clause_wall or r.started_wall)) * 1000, 1
                    ),
                }
            )
        st.turn = None
        st.turn_records.append(rec)
        session.stats.extra["turn_records"] = list(st.turn_records)
        if self.thinker is not None:
            ts = self.thinker.stats(session.id)
            session.stats.extra["thinker"] = {
                "resident_kv_tokens": ts.resident_kv_tokens,
                "log_tokens": ts.log_tokens,
                "prefill_tokens_last_append": ts.prefill_tokens_last_append,
                "cached_tokens_last_append": ts.cached_tokens_last_append,
                "ttft_ms_last_reply": ts.ttft_ms_last_reply,
                "trims": ts.trims,
                "memory_bytes": ts.memory_bytes,
            }

    def _emit_usage(self, session: DuplexSession) -> None:
        ctx = 0
        limit = self.settings.models.max_context_tokens
        if self.thinker is not None:
            ctx = self.thinker.stats(session.id).resident_kv_tokens
        session.emit(
            p.Usage(
                session_id=session.id,
                input_seconds=session.stats.input_samples / ENGINE_INPUT_RATE,
                output_seconds=session.stats.output_samples / ENGINE_OUTPUT_RATE,
                context_tokens=ctx,
                context_limit=limit,
            )
        )
