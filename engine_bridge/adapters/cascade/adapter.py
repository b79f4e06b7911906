"""The cascade adapter: turn-taking (VAD) → ASR → thinker with a KV lease → clause-by-clause TTS.

Where the time goes, and how the stages overlap (the plain sum of the stages is 1.5-2 s on a laptop CPU):

1. While the caller talks, the audio thread runs the VAD on every frame (microseconds).
2. After ``speculative_ms`` of silence (default 120 ms, well before the 500 ms endpoint) the turn's audio goes to
   the ASR worker *speculatively*; when the transcript comes back the thinker appends it to the session's KV and
   starts the reply, and the TTS worker voices the first clause. Audio produced before the endpoint is *held*.
3. At the endpoint the speculation is confirmed and the held audio is released at once. The endpoint is the
   semantic end-of-turn model's "finished" verdict on the speculative transcript (``end_of_turn = "model"``, the
   default), or ``eot_max_wait_ms`` of silence when it found the sentence unfinished; ``silence_ms`` alone with
   ``end_of_turn = "silence"``. If the caller speaks again first, the speculation is thrown away: the thinker rolls
   back to the checkpoint taken before the user text (exact, the KV is cropped), held audio is dropped, and the
   longer turn (both fragments, one utterance) is transcribed at its next pause.

Barge-in: at the first frame of caller speech over model speech the audio thread ducks the model's output (the
egress ring's gain word); the epoch word is bumped once the interruption is confirmed: ``barge_in_min_ms`` of
speech and, while ducked, a backchannel check (whisper hears only "mm-hm"/"yeah"-like words: the level comes back
and the answer goes on; any other word flushes). The scheduler then aborts generation at its next step, TTS output
of the old epoch is refused by the fence, and the thinker keeps only what was heard (playout position reported by
the media side in the ring header, up to where the duck began; until then, what was written to egress).

Threads: ``on_audio`` (audio thread) is cheap: VAD + fence. ASR and TTS run on one worker thread each (their
libraries release the GIL), the thinker runs on the scheduler thread, which owns every session's conversation.
Where each piece lives: the turn machine in :mod:`.turns`, a reply's lifecycle in :mod:`.reply`, the workers in
:mod:`.workers`, the mailbox messages in :mod:`.messages`, the turn records in :mod:`.telemetry`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from engine_bridge import protocol as p
from engine_bridge.adapters.base import AdapterCaps, ModelAdapter
from engine_bridge.adapters.cascade.text import TEXT_SID_PREFIX, TextCompletions
from engine_bridge.adapters.cascade.tools import tool_choice, tool_specs, tools_problem
from engine_bridge.adapters.cascade.turns import (
    BackchannelPolicy,
    CascadeSessionState,
    DuckPolicy,
    EndOfTurnPolicy,
    TurnMachine,
    cascade_state,
    watch_audio,
)
from engine_bridge.adapters.cascade.workers import AsrWorker, EotWorker, TtsWorker
from engine_bridge.config import EngineSettings
from engine_bridge.devices import onnx_providers, resolve_device
from engine_bridge.session import DuplexSession, SettingsChange
from engine_bridge.speech.asr import Transcriber, make_transcriber
from engine_bridge.speech.eot import EndOfTurnModel, LanguageModelEndOfTurn
from engine_bridge.speech.tts import EspeakSynthesizer, Synthesizer, make_synthesizer
from engine_bridge.speech.vad import TurnDetector, VADEngine, VADSettings, use_silero_providers
from engine_bridge.text import TextRefused, TextRequest
from engine_bridge.thinker.base import Message, ThinkerBackend, ThinkerError
from engine_bridge.thinker.factory import make_thinker, model_source, spoken_examples

log = logging.getLogger(__name__)

#: What an espeak-ng voice name looks like ("en", "en-us", "de", "pt-br"): only such names reach espeak-ng, which
#: would otherwise look any string up as a voice file path.
ESPEAK_VOICE_NAME = re.compile(r"[a-z]{2,3}(-[a-z0-9]{2,8}){0,2}")
#: Voices built per name and kept (espeak-ng voices cost nothing but a name); names beyond this use the default.
MAX_VOICES = 32


@dataclass(frozen=True, slots=True)
class CascadeModels:
    """Models built elsewhere (by a test, or a host that shares them), used instead of loading from settings.
    The executors run the ASR, end-of-turn and TTS jobs (default: one thread each). Without an end-of-turn model
    every session ends its turns by silence."""

    asr: Transcriber
    tts: Synthesizer
    thinker: ThinkerBackend
    asr_executor: concurrent.futures.Executor | None = None
    tts_executor: concurrent.futures.Executor | None = None
    eot: EndOfTurnModel | None = None
    eot_executor: concurrent.futures.Executor | None = None


class CascadeAdapter(ModelAdapter):
    name = "cascade"
    caps = AdapterCaps(
        owns_turn_taking=False, resident_kv=True, exact_rollback=True, text_completions=True, tools=True
    )

    def __init__(self, settings: EngineSettings, models: CascadeModels | None = None) -> None:
        super().__init__(settings)
        self._given = models
        self.asr: Transcriber | None = None
        self.tts: Synthesizer | None = None
        self.thinker: ThinkerBackend | None = None
        self.eot: EndOfTurnModel | None = None
        self.machine: TurnMachine | None = None
        self.text: TextCompletions | None = None
        self._kv_bytes = 0
        self._thinker_sessions = 0
        self._thinker_info: dict[str, Any] = {"backend": settings.thinker.backend}
        self._examples = spoken_examples(settings)
        #: espeak-ng voices built for sessions, by name (None: not an installed voice). Scheduler thread only.
        self._voices: dict[str, Synthesizer | None] = {}

    # --- lifecycle -----------------------------------------------------------------------------------------
    def load(self) -> None:
        m = self.settings.models
        given = self._given
        if given is not None:
            asr, tts, thinker, eot = given.asr, given.tts, given.thinker, given.eot
        else:
            device = resolve_device(self.settings.device)
            use_silero_providers(onnx_providers(device))
            t0 = time.monotonic()
            thinker = make_thinker(self.settings)
            t1 = time.monotonic()
            asr = make_transcriber(m.asr, threads=self.settings.threads, device=device, window=m.asr_window)
            asr.warmup()
            t2 = time.monotonic()
            tts = make_synthesizer(m.tts, threads=self.settings.threads, device=device)
            tts.warmup()
            t3 = time.monotonic()
            eot = self._load_eot()
            log.info(
                "cascade loaded on %s: thinker %s/%s %.1f s, asr %s %.1f s, tts %s %.1f s, end of turn %s %.1f s",
                device,
                self.settings.thinker.backend,
                self.settings.thinker.model,
                t1 - t0,
                m.asr,
                t2 - t1,
                m.tts,
                t3 - t2,
                eot.name if eot is not None else "off",
                time.monotonic() - t3,
            )
        self.asr, self.tts, self.thinker, self.eot = asr, tts, thinker, eot
        self.machine = TurnMachine(
            thinker,
            AsrWorker(asr, given.asr_executor if given else None),
            TtsWorker(tts, given.tts_executor if given else None),
            first_clause_words=self.settings.turn_taking.first_clause_words,
            context_limit=self.settings.thinker.max_model_len,
            examples=self._examples,
            eot=EotWorker(eot, given.eot_executor if given else None) if eot is not None else None,
            tool_turn_full_window=self.settings.models.asr_window_tools == "full",
        )
        if self.settings.thinker.max_text_requests > 0:
            self.text = TextCompletions(
                thinker,
                voice_slots=self.settings.max_sessions,
                voice_open=self._voice_sessions_open,
                model_name=Path(str(thinker.describe().get("model", ""))).name or self.settings.thinker.model,
                on_change=self._refresh_kv,
            )
        self._refresh_kv()

    def _load_eot(self) -> EndOfTurnModel | None:
        """The end-of-turn model, when any session may use it (``end_of_turn`` is per session; a model that fails
        to load is an error, not a silent fall-back to silence)."""
        tt = self.settings.turn_taking
        if tt.end_of_turn != "model":
            return None
        try:
            source = model_source(tt.eot_model)
            return LanguageModelEndOfTurn.load(source, cache_dir=self.settings.cache_dir / "models")
        except (OSError, ValueError, ThinkerError) as e:
            raise RuntimeError(
                f"the end-of-turn model {tt.eot_model!r} (engine.turn_taking.eot_model) did not load: {e}; "
                'set engine.turn_taking.end_of_turn = "silence" to end turns by silence alone'
            ) from e

    def _voice_sessions_open(self) -> int:
        assert self.thinker is not None
        return sum(not sid.startswith(TEXT_SID_PREFIX) for sid in self.thinker.session_ids())

    def _notify(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def describe(self) -> dict[str, Any]:
        m = self.settings.models
        return {
            "adapter": self.name,
            "models": {"asr": m.asr, "thinker": self.settings.thinker.model, "tts": m.tts},
            "device": resolve_device(self.settings.device),
            # Refreshed by the scheduler on open/close: the thinker is not safe to query from other threads.
            "thinker": self._thinker_info,
            "kv_bytes": self._kv_bytes,
            "thinker_sessions": self._thinker_sessions,
            "text_requests": self.text.running if self.text is not None else 0,
            "text_requests_aborted": self.text.aborted if self.text is not None else 0,
        }

    def _refresh_kv(self) -> None:
        if self.thinker is not None:
            self._kv_bytes = self.thinker.memory_bytes()
            self._thinker_sessions = len(self.thinker.session_ids())
            self._thinker_info = self.thinker.describe()

    def _vad_settings(self, session: DuplexSession) -> tuple[VADSettings, int, int, EndOfTurnPolicy]:
        """The session's detector settings, barge-in minimum, speculation window and end-of-turn policy: the
        engine's settings under the session's overrides."""
        tt = self.settings.turn_taking
        o = session.config.turn_taking
        engine = o.vad or tt.vad
        silence = o.silence_ms if o.silence_ms is not None else tt.silence_ms
        # The model reads the speculation's transcript: no automatic replies, no speculation, silence decides.
        model = (
            (o.end_of_turn or tt.end_of_turn) == "model"
            and self.eot is not None
            and o.auto_reply is not False
            and tt.speculative_ms > 0
        )
        eot = EndOfTurnPolicy(
            enabled=model,
            threshold=o.eot_threshold if o.eot_threshold is not None else tt.eot_threshold,
            silence_ms=silence,
        )
        max_wait = o.eot_max_wait_ms if o.eot_max_wait_ms is not None else tt.eot_max_wait_ms
        vs = VADSettings(
            engine=VADEngine(engine),
            aggressiveness=o.aggressiveness if o.aggressiveness is not None else tt.aggressiveness,
            threshold=o.threshold if o.threshold is not None else tt.threshold,
            prefix_padding_ms=o.prefix_padding_ms
            if o.prefix_padding_ms is not None
            else tt.prefix_padding_ms,
            # With the model, the detector's own window is the longest wait for an unfinished sentence.
            silence_ms=max(max_wait, silence) if model else silence,
        )
        barge = o.barge_in_min_ms if o.barge_in_min_ms is not None else tt.barge_in_min_ms
        return vs, barge, min(tt.speculative_ms, silence), eot

    def open(self, session: DuplexSession) -> None:
        assert self.thinker is not None and self.machine is not None, "load() first"
        vs, barge, spec, eot = self._vad_settings(session)
        history = [Message(role=t.role, text=t.text) for t in session.config.history]
        self.thinker.open(
            session.id,
            session.config.instructions or None,
            history or None,
            examples=self._examples,
            tools=tool_specs(session.config.tools),  # checked by check_tools before the session was admitted
        )
        auto_reply = session.config.turn_taking.auto_reply is not False
        if not auto_reply:
            spec = 0  # no reply to start early: every turn is transcribed once, at its endpoint
        tt = self.settings.turn_taking
        st = CascadeSessionState(
            TurnDetector(vs),
            barge,
            spec,
            auto_reply=auto_reply,
            duck=DuckPolicy.from_db(tt.duck_db, tt.duck_onset_ms, tt.duck_release_ms),
            backchannel=BackchannelPolicy.from_words(
                tt.backchannel_words, tt.backchannel_max_ms, tt.backchannel_pause_ms
            ),
            eot=eot,
            temperature=session.config.temperature,
            max_output_tokens=session.config.max_output_tokens,
            tool_choice=tool_choice(session.config.tool_choice),
            instructions=session.config.instructions,
            ack_delay_ms=session.config.acknowledgement_delay_ms,
        )
        st.voice, st.tts = self.voice(session.config.voice)
        self.machine.open(session, st)
        self._publish_settings(session, st)
        self._refresh_kv()

    def check_tools(self, tools: Sequence[p.ToolDef], choice: p.ToolChoiceSpec) -> str | None:
        if self.thinker is None:
            return "the engine is not loaded"
        return tools_problem(self.thinker, tools, choice)

    def voice(self, name: str) -> tuple[str, Synthesizer | None]:
        """The voice a session asked for by name: an installed espeak-ng voice ("en", "en-us", "de", "fr", ...)
        voices its replies with espeak-ng; any other name (the dialects' "marin", "alloy", ..., or "") gets the
        engine's configured TTS (None here). Returns the name of the voice used and its synthesizer."""
        default = (self.settings.models.tts, None)
        key = name.strip().lower()
        if not ESPEAK_VOICE_NAME.fullmatch(key):
            return default
        if key not in self._voices:
            if len(self._voices) >= MAX_VOICES:
                return default
            try:
                self._voices[key] = EspeakSynthesizer(key)
            except (ValueError, RuntimeError, OSError):
                self._voices[key] = None  # not an installed voice
        synth = self._voices[key]
        return (f"espeak:{key}", synth) if synth is not None else default

    def _apply_turn_taking(self, session: DuplexSession, st: CascadeSessionState) -> None:
        """``UpdateSession`` turn-taking (already merged into ``session.config``): the detector takes the new
        thresholds at its next frame (its own lock), the audio thread reads the barge-in minimum and the
        speculation window at its next chunk (plain attribute reads), the scheduler the auto-reply flag."""
        vs, barge, spec, eot = self._vad_settings(session)
        auto_reply = session.config.turn_taking.auto_reply is not False
        st.detector.update_settings(vs)
        st.eot = eot  # replaced whole: the audio thread reads it once per chunk
        st.barge_in_min_ms = barge
        st.speculative_ms = spec if auto_reply else 0
        st.auto_reply = auto_reply

    @staticmethod
    def _publish_settings(session: DuplexSession, st: CascadeSessionState) -> None:
        """The settings in force, in the session stats (what a client can check its ``session.update`` did)."""
        vs = st.detector.settings
        session.stats.extra["settings"] = {
            "voice": session.config.voice,
            "tts_voice": st.voice,
            "instructions": session.config.instructions,
            "temperature": st.temperature,
            "max_output_tokens": st.max_output_tokens,
            "vad": str(vs.engine.value),
            "threshold": vs.threshold,
            "prefix_padding_ms": vs.prefix_padding_ms,
            "silence_ms": st.eot.silence_ms if st.eot.enabled else vs.silence_ms,
            "end_of_turn": "model" if st.eot.enabled else "silence",
            "eot_threshold": st.eot.threshold,
            "eot_max_wait_ms": vs.silence_ms if st.eot.enabled else None,
            "barge_in_min_ms": st.barge_in_min_ms,
            "speculative_ms": st.speculative_ms,
            "auto_reply": st.auto_reply,
        }

    def close(self, session: DuplexSession) -> None:
        if self.machine is not None:
            self.machine.close(session)
        if self.thinker is not None:
            self.thinker.close(session.id)
        self._refresh_kv()

    # --- audio thread ----------------------------------------------------------------------------------------
    def on_audio(self, session: DuplexSession, pcm: npt.NDArray[np.int16]) -> None:
        st = cascade_state(session)
        if st is None:
            return
        for msg in watch_audio(session, st, pcm):
            session.post(msg)

    # --- scheduler thread ------------------------------------------------------------------------------------
    def handle(self, session: DuplexSession, msg: Any) -> None:
        st = cascade_state(session)
        if st is None or self.machine is None:
            return
        if isinstance(msg, SettingsChange) and msg.update.turn_taking is not None:
            self._apply_turn_taking(session, st)
        if isinstance(msg, SettingsChange) and msg.update.voice is not None:
            st.voice, st.tts = self.voice(msg.update.voice)  # from the next reply on
        self.machine.handle(session, st, msg)
        if isinstance(msg, SettingsChange):
            self._publish_settings(session, st)

    def step(self, sessions: list[DuplexSession]) -> bool:
        assert self.machine is not None
        pairs = [(s, st) for s in sessions if (st := cascade_state(s)) is not None]
        worked = self.machine.step(pairs)  # voice first: its step never waits on text
        if self.text is not None and self.text.has_work():
            worked |= self.text.step(voice_busy=self.machine.voice_busy(pairs))
        return worked

    # --- text requests -----------------------------------------------------------------------------------------
    def submit_text(self, request: TextRequest) -> None:
        if self.text is None:
            raise TextRefused(
                p.ErrorCode.UNSUPPORTED, "text completions are off (engine.thinker.max_text_requests)"
            )
        self.text.submit(request)
        self._notify()

    def has_text_work(self) -> bool:
        return self.text is not None and self.text.has_work()
