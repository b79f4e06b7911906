"""The cascade's turn machine: caller turns in, replies out.

Two halves, one per thread:

* :func:`watch_audio` runs on the **audio thread** for every chunk of caller audio. It feeds the turn detector and
  turns what it decides into mailbox messages: a turn started, speculate now, the caller resumed, the endpoint,
  and barge-in (for which it bumps the epoch fence *first*). Its only state is a :class:`CallerTurnWatch`; it
  reads the reply through the session's published snapshot (``DuplexSession.model_audible``).
* :class:`TurnMachine` runs on the **scheduler thread**, which owns the conversation: it handles those messages
  and the ASR/TTS results, starts, confirms, interrupts and cancels replies (each through its one transition
  method, :meth:`Reply.advance <engine_bridge.adapters.cascade.reply.Reply.advance>`), and steps the thinker.

Speculation: after ``speculative_ms`` of silence the turn's audio is transcribed and a reply started before the
endpoint, with its audio held. The endpoint keeps it (announced at once, held audio released); the caller speaking
again first discards it, and the thinker rolls back to before the caller's words.

End of turn (``EndOfTurnPolicy``): with the semantic end-of-turn model, the detector's silence window is the longest
wait (``eot_max_wait_ms``), and the speculation's transcript also goes to the model (the end-of-turn worker). A
"finished" verdict is written into the watch; the audio thread, at its next chunk, ends the turn in that same pause
(``TurnDetector.end_turn``), so the endpoint comes as always from the detector's owner. Speech before that continues
the same turn: its fragments are one utterance, transcribed whole at the next pause.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import re
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from engine_bridge import protocol as p
from engine_bridge.adapters.cascade.messages import (
    AsrDone,
    BargeInHeard,
    CascadeMessage,
    Endpoint,
    EotDone,
    HeardUntil,
    OverlapCheck,
    Resumed,
    Speculate,
    TtsDone,
    VadStart,
)
from engine_bridge.adapters.cascade.reply import Cut, Reply
from engine_bridge.adapters.cascade.telemetry import (
    TURN_RECORDS,
    USAGE_EVERY_S,
    emit_usage,
    publish_turn,
    turn_record,
)
from engine_bridge.adapters.cascade.tools import call_item, thinker_call, tool_choice, tool_specs
from engine_bridge.adapters.cascade.workers import AsrWorker, EotWorker, TtsWorker
from engine_bridge.formats import ENGINE_OUTPUT_RATE, samples_to_ms
from engine_bridge.reply import ReplyPhase
from engine_bridge.session import (
    AdapterState,
    DuplexSession,
    InterruptRequest,
    MuteChange,
    Role,
    Segment,
    SettingsChange,
    TextAppend,
    TruncateRequest,
)
from engine_bridge.speech.asr import DEFAULT_DECODING, Decoding, Transcript
from engine_bridge.speech.text import clean_for_tts, early_first_clause_ready, normalize_text, text_words
from engine_bridge.speech.tts import OutputResampler, Synthesizer
from engine_bridge.speech.vad import SpeechStarted, SpeechStopped, TurnDetector, TurnEvent
from engine_bridge.thinker.base import DecodingSettings, Message, StepOutput, ThinkerBackend
from engine_bridge.thinker.base import Role as ThinkerRole
from engine_bridge.thinker.tools import TOOL_CHOICE_AUTO, ToolChoice, ToolSpec
from engine_bridge.thinker.turns import reinstruct

log = logging.getLogger(__name__)

#: The thinker's role of each conversation-log role (the system segment is the thinker's own).
_THINKER_ROLE: Final[dict[Role, ThinkerRole]] = {
    Role.SYSTEM: "system",
    Role.DEVELOPER: "developer",
    Role.USER: "user",
    Role.ASSISTANT: "assistant",
    Role.TOOL: "tool",
}

COMMENTARY_PROMPT: Final = "Say the following to the caller now, briefly and in your own words: "
#: What the caller hears while a function call's result is awaited (``acknowledgement_delay_ms``): said as it is,
#: not generated, so it is short and the same every time.
ACKNOWLEDGEMENT: Final = "One moment, please."
SPEAK_NOW_PROMPT: Final = "Speak to the caller now, briefly, without waiting for them to speak first."


# --- per-session state -----------------------------------------------------------------------------------------


class Overlap(enum.Enum):
    """How the caller's current turn relates to model speech (the audio thread's view)."""

    #: The turn began while the model was silent.
    CLEAR = "clear"
    #: The turn began over model speech and is undecided: under the barge-in minimum (a backchannel so far), or
    #: past it with the reply ducked while the backchannel check decides. It neither speculates nor, if it ends
    #: under the minimum, interrupts.
    OVER_MODEL = "over_model"
    #: The backchannel check found only backchannel words ("mm-hm") so far: the level is back and the reply goes
    #: on; more speech in the turn makes it undecided again.
    BACKCHANNEL = "backchannel"
    #: The barge-in fired in this turn.
    BARGED = "barged"


@dataclass(frozen=True, slots=True)
class DuckPolicy:
    """The barge-in duck: caller sound over model speech lowers the model's output (the egress ring's gain word,
    applied by the media plane at its next frame) after ``onset_ms`` of speech frames (20: the first frame of
    either VAD), long before anything is decided; the barge-in then flushes, or the sound turns out a backchannel
    and the level comes back (``release_ms`` after it, or at the backchannel check's verdict)."""

    gain: float = 1.0  # 1.0: no duck
    onset_ms: int = 20
    release_ms: int = 160

    @classmethod
    def from_db(cls, db: float, onset_ms: int, release_ms: int) -> DuckPolicy:
        return cls(10.0 ** (-db / 20.0) if db > 0 else 1.0, onset_ms, release_ms)

    @property
    def enabled(self) -> bool:
        return self.gain < 1.0


#: Whisper's prompt for the backchannel check: told that such sounds come, tiny.en writes Piper's "Mm-hm." as
#: "Mm-hm." instead of "And then make some.", and still hears "Wait.", "Stop.", "No." and "Hold on." as they are
#: (measured on Piper clips, clean and through Opus; docs/architecture.md, The duck).
BACKCHANNEL_PROMPT: Final = "Mm-hm. Uh-huh. Yeah. Right. Okay."
#: The check decodes no more than this: the first few words decide, and whisper, told to expect backchannels,
#: repeats a short one ("Yeah. Yeah. Yeah. ...") up to its bound.
BACKCHANNEL_MAX_TOKENS: Final = 12
#: The check's decoding: only the words matter (no word times), and whisper is told backchannels come.
BACKCHANNEL_DECODING: Final = Decoding(
    prompt=BACKCHANNEL_PROMPT, word_times=False, max_tokens=BACKCHANNEL_MAX_TOKENS
)
#: A caller turn of a session with tools: whisper's whole window (its words become arguments; speech/asr.py).
TOOL_TURN_DECODING: Final = Decoding(full_window=True)
#: A hum as whisper writes it ("Mm-", "M-H-M", "Hm"): letters m and h only, each word a backchannel.
_HUM_WORD: Final = re.compile(r"[mh]+")


@dataclass(frozen=True, slots=True)
class BackchannelPolicy:
    """When the reply is ducked, caller speech over it that passes the barge-in minimum flushes only once it is
    confirmed: at its first pause of ``pause_ms`` its words are transcribed (whisper, :data:`BACKCHANNEL_PROMPT`)
    and only backchannel ``words`` (or none: a cough) restore the level and keep the reply; any other word
    flushes. Speech that goes on for ``max_ms`` flushes without a check (no backchannel lasts that long). Off
    (``max_ms`` 0, or no duck): the barge-in minimum alone decides, as without the duck."""

    max_ms: int = 1000
    pause_ms: int = 120
    words: frozenset[str] = frozenset()

    @classmethod
    def from_words(cls, words: Sequence[str], max_ms: int, pause_ms: int) -> BackchannelPolicy:
        parts = {w for phrase in words for w in [normalize_text(phrase), *text_words(phrase)] if w}
        return cls(max_ms, pause_ms, frozenset(parts))

    @property
    def enabled(self) -> bool:
        return self.max_ms > 0

    def is_backchannel(self, text: str) -> bool:
        """True when ``text`` holds no word but backchannel words and hums (words of m and h only: whisper writes
        a closed-mouth "mm-hm" as "Mm- Mm" or "M-H-M"). Its last word may be cut short (the decoder's token bound
        stops a repeated "Yeah. Yeah. Ye"): a prefix of a backchannel word counts."""
        said = text_words(text)
        if not said:
            return True
        *whole, last = said
        return all(self._is_backchannel_word(w) for w in whole) and (
            self._is_backchannel_word(last) or any(w.startswith(last) for w in self.words)
        )

    def _is_backchannel_word(self, word: str) -> bool:
        return word in self.words or _HUM_WORD.fullmatch(word) is not None


@dataclass(frozen=True, slots=True)
class EndOfTurnPolicy:
    """How a pause ends the caller's turn. Off: the detector's ``silence_ms`` alone. On: the detector's window is
    the longest wait, and the end-of-turn model's verdict on the pause's speculative transcript (probability at
    least ``threshold``: finished) ends the turn at once; a turn over model speech (an undecided or backchannel
    sound: no question to judge) ends after ``silence_ms``, as without the model."""

    enabled: bool = False
    threshold: float = 0.5
    silence_ms: int = 500


@dataclass(slots=True)
class CallerTurnWatch:
    """Audio-thread state of the caller's current turn."""

    overlap: Overlap = Overlap.CLEAR
    #: Start of the current (or last) turn, and its speech so far (what it had when it ended).
    turn_start_ms: int = 0
    voiced_ms: int = 0
    #: End of the audio posted for speculative ASR in this turn, or None while no speculation is out.
    speculated_to_ms: int | None = None
    #: End of the speech posted for the backchannel check, or None while none is out (or speech came after it).
    checking_to_ms: int | None = None
    #: End of the speech of the pause the end-of-turn model found finished (the scheduler writes it, under
    #: ``overlap_lock``); the turn ends while that pause lasts.
    finished_at_ms: int | None = None
    #: The model's output is ducked (see :class:`DuckPolicy`); the stream position of the last speech frame.
    ducked: bool = False
    voice_at_ms: int = 0
    #: The egress playout report when the duck began: what the caller had heard of the reply at full level.
    heard_at_duck: tuple[int, int, int] = (0, 0, 0)

    def heard(self) -> HeardUntil:
        return self.heard_at_duck if self.ducked else None


class TurnPhase(enum.IntEnum):
    """A caller turn being transcribed (scheduler thread)."""

    #: Sent to ASR before the endpoint; the caller may still go on.
    SPECULATIVE = 0
    #: The speculation was confirmed by the endpoint (same turn start).
    KEPT = 1
    #: Sent to ASR at the endpoint.
    FINAL = 2

    @property
    def confirmed(self) -> bool:
        return self >= TurnPhase.KEPT


@dataclass(slots=True)
class CallerTurn:
    job: int
    start_ms: int
    end_ms: int
    phase: TurnPhase
    #: When its audio went to ASR, and when its endpoint came.
    at_wall: float
    endpoint_wall: float | None = None
    transcript: Transcript | None = None
    asr_ms: float = 0.0
    #: Silence the endpoint waited (from the last speech frame to the decision), once it came.
    pause_ms: int | None = None

    @property
    def speculated(self) -> bool:
        return self.phase <= TurnPhase.KEPT


@dataclass(slots=True)
class PendingCheck:
    """A backchannel check out at ASR (scheduler thread)."""

    job: int
    msg: OverlapCheck
    #: The turn's endpoint when it came before the verdict (held until then).
    endpoint: Endpoint | None = None
    #: The verdict once it came: True for a backchannel.
    backchannel: bool | None = None


@dataclass(frozen=True, slots=True)
class ContextNote:
    """Text for the conversation that waits until no reply runs (a reply's KV must not change under it)."""

    role: Literal["user", "developer", "assistant", "tool"]
    text: str
    #: For the next reply only (the Realtime dialect's per-response instructions): removed once it ends.
    transient: bool = False
    #: An assistant note that is a function call (``text``: words said before it); a tool note's call.
    call: p.ToolCallItem | None = None
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class SpeakRequest:
    """A ``speak_now``/``commentary``/``respond`` asked for a reply while another ran: one reply starts when it
    ends."""

    #: The reply's own token cap (0: the session's).
    max_output_tokens: int = 0
    #: The reply's own tool choice (None: the session's).
    tool_choice: p.ToolChoiceSpec | None = None


@dataclass(frozen=True, slots=True)
class InstructionsChange:
    """New session instructions or tools (None: unchanged): the thinker's system segment, which lists the tools,
    is rebuilt once no reply runs."""

    text: str | None = None
    tools: tuple[ToolSpec, ...] | None = None


Pending = ContextNote | SpeakRequest | TruncateRequest | InstructionsChange


@dataclass(slots=True)
class CascadeSessionState(AdapterState):
    detector: TurnDetector
    barge_in_min_ms: int
    speculative_ms: int
    #: False: caller turns join the conversation without a reply (the client asks for replies).
    auto_reply: bool = True
    duck: DuckPolicy = field(default_factory=DuckPolicy)
    backchannel: BackchannelPolicy = field(default_factory=BackchannelPolicy)
    eot: EndOfTurnPolicy = field(default_factory=EndOfTurnPolicy)
    #: The session's reply decoding over the thinker's default: sampling temperature (None: the default's) and
    #: a token cap per reply (0: the default's ``max_tokens``). ``UpdateSession`` changes them.
    temperature: float | None = None
    max_output_tokens: int = 0
    #: Whether the session's replies may, may not or must call one of its tools (a reply's own choice wins).
    tool_choice: ToolChoice = TOOL_CHOICE_AUTO
    #: The session's instructions as the client gave them (the system segment also lists the tools).
    instructions: str = ""
    #: Spoken acknowledgement of a call whose result is awaited: the delay (-1: none), when it is due (None: none
    #: pending) and the calls it waits on (a result for any of them, other words for the caller, or a reply
    #: starting cancel it).
    ack_delay_ms: int = -1
    ack_due: float | None = None
    ack_calls: set[str] = field(default_factory=set)
    #: The session's voice: its synthesizer (None: the engine's default TTS) and name, for the next reply.
    tts: Synthesizer | None = None
    voice: str = ""
    #: The audio thread's; the scheduler changes it only to apply a backchannel check's verdict, both under
    #: ``overlap_lock`` (the verdict and the audio thread's own barge-in must not both flush, or restore a level
    #: the other just lowered).
    watch: CallerTurnWatch = field(default_factory=CallerTurnWatch)
    overlap_lock: threading.Lock = field(default_factory=threading.Lock)
    # --- scheduler thread only ---
    turn: CallerTurn | None = None
    #: The latest backchannel check (out at ASR, or its verdict).
    check: PendingCheck | None = None
    #: The reply being produced; never a finished one (it is dropped here as it finishes).
    reply: Reply | None = None
    pending: list[Pending] = field(default_factory=list)
    #: One-time instructions in the conversation for the reply now running (removed when it ends).
    transient: list[Segment] = field(default_factory=list)
    turn_records: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=TURN_RECORDS)
    )
    last_usage: float = field(default_factory=time.monotonic)
    item_seq: int = 0


def cascade_state(session: DuplexSession) -> CascadeSessionState | None:
    st = session.adapter_state
    return st if isinstance(st, CascadeSessionState) else None


# --- audio thread ------------------------------------------------------------------------------------------------


def watch_audio(
    session: DuplexSession, st: CascadeSessionState, pcm: npt.NDArray[np.int16]
) -> list[CascadeMessage]:
    """Feed caller audio to the turn detector; return the messages for the scheduler (already fenced)."""
    det = st.detector
    events = det.push(pcm)  # the VAD's work stays outside the lock
    with st.overlap_lock:
        return _watch_locked(session, st, events)


def _watch_locked(
    session: DuplexSession, st: CascadeSessionState, events: list[TurnEvent]
) -> list[CascadeMessage]:
    det = st.detector
    w = st.watch
    # The word check waits for confirmation only while the answer is ducked (inaudible); without the duck the
    # barge-in minimum alone decides, or the model would talk over the caller until the check is done.
    checks = st.backchannel.enabled and st.duck.enabled
    posted: list[CascadeMessage] = []
    if st.eot.enabled and det.in_speech and not any(isinstance(ev, SpeechStarted) for ev in events):
        stopped = _end_of_turn(st, det, w)
        if stopped is not None:
            events = [*events, stopped]
    for ev in events:
        if isinstance(ev, SpeechStarted):
            w.speculated_to_ms = w.checking_to_ms = w.finished_at_ms = None
            w.turn_start_ms, w.voiced_ms = ev.start_ms, 0
            w.overlap = Overlap.OVER_MODEL if session.model_audible() else Overlap.CLEAR
            posted.append(VadStart(ev.start_ms, ev.at_ms))
            continue
        undecided = w.overlap is Overlap.OVER_MODEL and w.checking_to_ms is not None
        if checks and not undecided and w.overlap is Overlap.OVER_MODEL and w.voiced_ms >= st.barge_in_min_ms:
            # Past the minimum but never paused long enough for a check before the endpoint: check it whole.
            w.checking_to_ms = ev.end_ms
            posted.append(OverlapCheck(ev.audio, ev.start_ms, ev.end_ms, time.monotonic(), w.heard()))
            undecided = True
        backchannel = w.overlap in (Overlap.OVER_MODEL, Overlap.BACKCHANNEL) and not undecided
        posted.append(Endpoint(ev, time.monotonic(), backchannel=backchannel, undecided=undecided))
        w.speculated_to_ms = None
    if det.in_speech:
        w.voiced_ms = det.speech_ms
        speaking = det.silence_ms_so_far == 0
        if speaking and w.checking_to_ms is not None:
            w.checking_to_ms = (
                None  # more speech: the check no longer covers the turn (a flush it finds still holds)
            )
        if speaking and w.overlap is Overlap.BACKCHANNEL:
            w.overlap = Overlap.OVER_MODEL  # "yeah, but ...": undecided again
        if w.speculated_to_ms is not None and speaking:
            w.speculated_to_ms = None
            posted.append(Resumed(det.position_ms))
        elif (
            w.speculated_to_ms is None
            and st.speculative_ms > 0
            and det.silence_ms_so_far >= st.speculative_ms
            and w.overlap in (Overlap.CLEAR, Overlap.BARGED)
        ):
            end = det.speech_end_ms or 0
            w.speculated_to_ms = end
            posted.append(Speculate(det.utterance(), det.turn_start_ms or 0, end, time.monotonic()))
        if det.speech_ms >= st.barge_in_min_ms:
            if w.overlap is Overlap.CLEAR:
                barge = session.model_audible()  # the model began speaking over the caller's turn
            elif w.overlap is Overlap.OVER_MODEL:
                barge = not checks or det.speech_ms >= st.backchannel.max_ms
                if (
                    not barge
                    and w.checking_to_ms is None
                    and det.silence_ms_so_far >= st.backchannel.pause_ms
                ):
                    end = det.position_ms - det.silence_ms_so_far
                    w.checking_to_ms = end
                    posted.append(
                        OverlapCheck(
                            det.utterance(), det.turn_start_ms or 0, end, time.monotonic(), w.heard()
                        )
                    )
            else:
                barge = False
            if barge:
                log.info(
                    "session %s: barge-in at %d ms of speech (%s)",
                    session.id,
                    det.speech_ms,
                    w.overlap.value,
                )
                # The fence goes up *first*: the media plane drops queued stale audio at its next frame.
                w.overlap = Overlap.BARGED
                w.checking_to_ms = None
                heard = w.heard()
                epoch = session.bump_epoch()
                posted.append(BargeInHeard(epoch, det.position_ms, time.monotonic(), heard))
    if st.duck.enabled:
        _duck(session, st, det, w)
    return posted


def _end_of_turn(st: CascadeSessionState, det: TurnDetector, w: CallerTurnWatch) -> SpeechStopped | None:
    """With the end-of-turn model on, the pause that ends the turn before the detector's longest wait: the one the
    model found finished, or, for a turn over model speech, ``silence_ms`` of it."""
    silent = det.silence_ms_so_far
    if silent == 0:
        return None
    finished = w.finished_at_ms is not None and w.finished_at_ms == det.speech_end_ms
    plain = w.overlap in (Overlap.OVER_MODEL, Overlap.BACKCHANNEL) and silent >= st.eot.silence_ms
    return det.end_turn() if finished or plain else None


def _duck(session: DuplexSession, st: CascadeSessionState, det: TurnDetector, w: CallerTurnWatch) -> None:
    """Lower the model's output at the first frames of caller sound over it; lift it after a barge-in (the epoch
    is already bumped: the media plane reads the gain before the epoch) or after a silence that ended no turn,
    unless the backchannel check is deciding (its verdict restores the level or flushes)."""
    policy = st.duck
    voiced_ms = det.run_ms or (det.speech_ms if det.silence_ms_so_far == 0 else 0)
    if voiced_ms:
        w.voice_at_ms = det.position_ms
    barged = det.in_speech and w.overlap is Overlap.BARGED  # this turn's barge-in (not the previous turn's)
    deciding = w.overlap is Overlap.OVER_MODEL and (
        w.checking_to_ms is not None or det.speech_ms >= st.barge_in_min_ms
    )
    if w.ducked:
        if barged:
            _lift(session, w)
        elif not deciding and det.position_ms - w.voice_at_ms >= policy.release_ms:
            _lift(session, w, released=True)
    elif voiced_ms >= policy.onset_ms and not barged and session.model_audible():
        w.ducked = True
        w.heard_at_duck = session.rings.egress.playout()
        session.rings.egress.set_gain(policy.gain)
        session.stats.extra["ducks"] = session.stats.extra.get("ducks", 0) + 1


def _lift(session: DuplexSession, w: CallerTurnWatch, *, released: bool = False) -> None:
    """The reply's level back to unity; ``released``: the sound was a backchannel (counted)."""
    w.ducked = False
    session.rings.egress.set_gain(1.0)
    if released:
        session.stats.extra["duck_releases"] = session.stats.extra.get("duck_releases", 0) + 1


# --- scheduler thread -------------------------------------------------------------------------------------------


class TurnMachine:
    """Everything the scheduler thread does for cascade sessions (see the module docstring)."""

    def __init__(
        self,
        thinker: ThinkerBackend,
        asr: AsrWorker,
        tts: TtsWorker,
        *,
        first_clause_words: int,
        context_limit: int,
        examples: Sequence[Message] = (),
        eot: EotWorker | None = None,
        tool_turn_full_window: bool = True,
    ) -> None:
        self.thinker = thinker
        self.asr = asr
        self.tts = tts
        #: The end-of-turn model's worker (None: no model; every session ends turns by silence).
        self.eot = eot
        self.first_clause_words = first_clause_words
        self.context_limit = context_limit
        #: The example turns sessions open with (kept when new instructions rebuild the system segment).
        self.examples = tuple(examples)
        #: Caller turns of sessions with tools get whisper's whole window (``models.asr_window_tools``).
        self.tool_turn_full_window = tool_turn_full_window

    def open(self, session: DuplexSession, st: CascadeSessionState) -> None:
        session.adapter_state = st
        # The conversation log mirrors the thinker's token log: system prompt, then the startup history.
        for seg in self.thinker.log(session.id).segments:
            session.log.append(
                Segment(Role(seg.role), seg.text, session.epoch, token_start=seg.start, token_end=seg.end)
            )

    def close(self, session: DuplexSession) -> None:
        st = cascade_state(session)
        if st is not None and st.reply is not None:
            st.reply.advance(ReplyPhase.CANCELLED)  # TTS work still queued for it stops at its next chunk
            st.reply = None

    # --- mailbox ------------------------------------------------------------------------------------------------
    def handle(self, session: DuplexSession, st: CascadeSessionState, msg: object) -> None:
        match msg:
            case VadStart():
                session.emit(p.SpeechStarted(session_id=session.id, at_ms=msg.start_ms))
                if st.reply is None:
                    session.set_state(p.SessionState.USER_SPEAKING)
            case Speculate():
                if st.reply is None:
                    self._submit_asr(
                        session, st, msg.audio, msg.start_ms, msg.end_ms, TurnPhase.SPECULATIVE, msg.at_wall
                    )
            case Resumed():
                self._discard_speculation(session, st)
            case Endpoint():
                self._on_endpoint(session, st, msg)
            case BargeInHeard():
                self._on_barge_in(
                    session, st, msg.epoch, msg.at_ms, msg.at_wall, barge_in=True, heard=msg.heard
                )
            case OverlapCheck():
                job = self.asr.next_job()
                st.check = PendingCheck(job, msg)
                # Only the words matter here (no word times), and whisper is told backchannels come.
                self.asr.submit(session, job, msg.audio, BACKCHANNEL_DECODING)
            case AsrDone():
                if st.check is not None and st.check.job == msg.job and st.check.backchannel is None:
                    self._on_check(session, st, st.check, msg)
                else:
                    self._on_asr(session, st, msg)
            case EotDone():
                self._on_eot(session, st, msg)
            case TtsDone():
                r = st.reply
                if r is not None and r.turn_id == msg.turn_id and r.epoch == msg.epoch:
                    r.clauses_done += 1
            case TextAppend():
                self._on_text(session, st, msg)
            case InterruptRequest():
                # The engine core already bumped the epoch; end the reply as a barge-in would, keeping what played.
                if st.reply is not None:
                    self._on_barge_in(
                        session, st, msg.epoch, session.input_ms, time.monotonic(), barge_in=False
                    )
            case TruncateRequest():
                st.pending.append(msg)
                if st.reply is None:
                    self._flush_context(session, st)
            case SettingsChange():
                self._on_settings(session, st, msg.update)
            case MuteChange():
                if msg.muted:
                    st.detector.reset()
            case _:
                log.warning("session %s: unexpected mailbox message %r", session.id, msg)

    def _submit_asr(
        self,
        session: DuplexSession,
        st: CascadeSessionState,
        audio: npt.NDArray[np.int16],
        start_ms: int,
        end_ms: int,
        phase: TurnPhase,
        at: float,
    ) -> None:
        job = self.asr.next_job()
        st.turn = CallerTurn(job, start_ms, end_ms, phase, at_wall=at)
        if phase is TurnPhase.FINAL:
            st.turn.endpoint_wall = at
        # A session with tools turns the caller's words into a tool's arguments (a city, a date, an order number):
        # its turns get whisper's whole window, which hears more names right than the fitted one, for ~0.5 s more.
        full = self.tool_turn_full_window and bool(self.thinker.session_tools(session.id))
        self.asr.submit(session, job, audio, TOOL_TURN_DECODING if full else DEFAULT_DECODING)

    def _discard_speculation(self, session: DuplexSession, st: CascadeSessionState) -> None:
        turn = st.turn
        if turn is None or turn.phase is not TurnPhase.SPECULATIVE:
            return
        st.turn = None
        r = st.reply
        if r is not None and r.phase.is_speculative:
            st.reply = None
            self._unwind(session, r)
            session.stats.extra["speculations_discarded"] = (
                session.stats.extra.get("speculations_discarded", 0) + 1
            )

    def _unwind(self, session: DuplexSession, r: Reply) -> None:
        """Undo a speculative reply entirely, with the caller's words it answered: crop the KV back to before
        them (exact), and drop them from the conversation log, which mirrors the thinker's."""
        if self.thinker.is_generating(session.id):
            self.thinker.rollback(session.id, r.ckpt_log_len)
        if r.user_ckpt_log_len is not None:
            self.thinker.rollback(session.id, r.user_ckpt_log_len)
        del session.log[r.log_mark :]
        r.advance(ReplyPhase.CANCELLED)

    def _on_check(
        self, session: DuplexSession, st: CascadeSessionState, check: PendingCheck, done: AsrDone
    ) -> None:
        """The backchannel check's verdict: only backchannel words restore the reply's level (it goes on); any
        other word flushes, as the audio thread's barge-in does (the fence first, then the level back)."""
        msg = check.msg
        backchannel = check.backchannel = st.backchannel.is_backchannel(done.transcript.text)
        extra = session.stats.extra
        extra["backchannel_checks"] = extra.get("backchannel_checks", 0) + 1
        extra["backchannel_check_ms"] = round(done.elapsed_ms, 1)
        extra["backchannel_check_heard"] = (
            done.transcript.text
        )  # what decided it, for the reader of the stats
        w = st.watch
        epoch: int | None = None
        heard = msg.heard
        with st.overlap_lock:
            current = w.turn_start_ms == msg.start_ms and w.overlap is Overlap.OVER_MODEL
            if backchannel and current and w.checking_to_ms == msg.end_ms:
                w.overlap, w.checking_to_ms = Overlap.BACKCHANNEL, None
                if w.ducked:
                    _lift(session, w, released=True)
            elif not backchannel and (current or check.endpoint is not None):
                # A turn that already ended (its endpoint held here) is flushed too, though another may have begun.
                if current:
                    w.overlap, w.checking_to_ms = Overlap.BARGED, None
                    heard = w.heard()
                epoch = session.bump_epoch()
                if current and w.ducked:
                    _lift(session, w)
        log.info(
            "session %s: backchannel check of %d-%d ms heard %r in %.0f ms: %s",
            session.id,
            msg.start_ms,
            msg.end_ms,
            done.transcript.text,
            done.elapsed_ms,
            "a backchannel" if backchannel else "an interruption",
        )
        if backchannel:
            extra["backchannels"] = extra.get("backchannels", 0) + 1
        if epoch is not None:
            self._on_barge_in(session, st, epoch, msg.end_ms, msg.at_wall, barge_in=True, heard=heard)
        if check.endpoint is not None:
            # The turn is over: a backchannel is dropped like any backchannel, an interruption is a caller turn.
            endpoint, check.endpoint = check.endpoint, None
            self._on_endpoint(session, st, dataclasses.replace(endpoint, backchannel=backchannel))

    def _on_endpoint(self, session: DuplexSession, st: CascadeSessionState, msg: Endpoint) -> None:
        ev = msg.ev
        if msg.undecided:
            check = st.check
            if check is not None and check.msg.start_ms == ev.start_ms and check.backchannel is None:
                check.endpoint = dataclasses.replace(msg, undecided=False)
                return  # SpeechStopped goes out with the verdict
            # The verdict came while the endpoint was on its way (no check of this turn: treat it as speech).
            verdict = check.backchannel if check is not None and check.msg.start_ms == ev.start_ms else False
            msg = dataclasses.replace(msg, undecided=False, backchannel=bool(verdict))
        session.emit(p.SpeechStopped(session_id=session.id, at_ms=ev.end_ms))
        session.stats.extra["endpoint_pause_ms"] = ev.at_ms - ev.end_ms
        if msg.backchannel:
            session.stats.ignored_short_speech += 1
            self._discard_speculation(session, st)
            return
        turn = st.turn
        if turn is not None and turn.phase is TurnPhase.SPECULATIVE and turn.start_ms == ev.start_ms:
            turn.phase = TurnPhase.KEPT
            turn.end_ms = ev.end_ms
            turn.endpoint_wall = msg.at_wall
            turn.pause_ms = ev.at_ms - ev.end_ms
            if turn.transcript is not None:
                self._emit_input(session, st, turn)
            r = st.reply
            if r is not None and r.phase.is_speculative:
                r.advance(ReplyPhase.GENERATING if r.phase is ReplyPhase.SPECULATIVE else ReplyPhase.VOICING)
        else:
            self._discard_speculation(session, st)
            self._submit_asr(session, st, ev.audio, ev.start_ms, ev.end_ms, TurnPhase.FINAL, msg.at_wall)
            if st.turn is not None:
                st.turn.pause_ms = ev.at_ms - ev.end_ms
        if st.reply is None:
            session.set_state(p.SessionState.THINKING)

    def _emit_input(self, session: DuplexSession, st: CascadeSessionState, turn: CallerTurn) -> None:
        assert turn.transcript is not None
        st.item_seq += 1
        session.emit(
            p.InputTranscript(
                session_id=session.id,
                item_id=f"item_{session.id[-8:]}_{st.item_seq}",
                text=turn.transcript.text.strip(),
                start_ms=turn.start_ms,
                end_ms=max(turn.end_ms, turn.start_ms),
                final=True,
            )
        )

    def _on_asr(self, session: DuplexSession, st: CascadeSessionState, msg: AsrDone) -> None:
        turn = st.turn
        if turn is None or turn.job != msg.job:
            return  # a discarded speculation
        turn.transcript = msg.transcript
        turn.asr_ms = msg.elapsed_ms
        text = msg.transcript.text.strip()
        if not text:
            st.turn = None
            if turn.phase.confirmed and st.reply is None:
                session.set_state(p.SessionState.LISTENING)
            return
        if turn.phase.confirmed:
            self._emit_input(session, st, turn)
        elif st.eot.enabled and self.eot is not None:
            # The pause's transcript: is the sentence finished? (The reply is prepared meanwhile, held.)
            self.eot.submit(session, turn.job, text)
        if st.reply is not None or not st.auto_reply:
            # A reply is still running (commentary, or the caller's short turn during speech), or the client asks
            # for replies itself: just log the caller's words (once no reply runs).
            st.pending.append(ContextNote("user", text))
            if st.reply is None:
                self._flush_context(session, st)
                session.set_state(p.SessionState.LISTENING)
            return
        self._start_reply(session, st, user_text=text, turn=turn)

    def _on_eot(self, session: DuplexSession, st: CascadeSessionState, msg: EotDone) -> None:
        """The end-of-turn model's verdict on a pause: finished ends the turn in that pause (the audio thread ends
        it at its next chunk if the caller is still silent); not finished leaves it to the longest wait."""
        extra = session.stats.extra
        extra["eot_checks"] = extra.get("eot_checks", 0) + 1
        timings = extra.setdefault("eot_ms", [])
        timings.append(round(msg.elapsed_ms, 1))
        del timings[:-TURN_RECORDS]
        extra["eot_probability"] = round(msg.probability, 5)
        turn = st.turn
        if turn is None or turn.job != msg.job or turn.phase is not TurnPhase.SPECULATIVE:
            return  # the caller went on, or the silence already ended the turn
        finished = msg.probability >= st.eot.threshold
        log.info(
            "session %s: end-of-turn model on %r: %.4f in %.0f ms: %s",
            session.id,
            turn.transcript.text if turn.transcript else "",
            msg.probability,
            msg.elapsed_ms,
            "finished" if finished else "not finished",
        )
        if finished:
            extra["eot_finished"] = extra.get("eot_finished", 0) + 1
            with st.overlap_lock:
                st.watch.finished_at_ms = turn.end_ms

    def _on_text(self, session: DuplexSession, st: CascadeSessionState, msg: TextAppend) -> None:
        if msg.kind in ("instructions", "thinking", "commentary", "speak_now"):
            st.ack_due = None  # the client gave the caller (or the model) other words: no acknowledgement
        if msg.kind in ("instructions", "thinking"):
            if msg.text:
                st.pending.append(ContextNote("developer", msg.text))
        elif msg.kind in ("user", "assistant"):
            if msg.text:
                st.pending.append(ContextNote("user" if msg.kind == "user" else "assistant", msg.text))
        elif msg.kind == "respond":
            if msg.text:
                st.pending.append(ContextNote("developer", msg.text, transient=True))
            st.pending.append(SpeakRequest(msg.max_output_tokens, msg.tool_choice))
        elif msg.kind == "tool_call":
            if msg.call is not None:
                st.pending.append(ContextNote("assistant", msg.text, call=msg.call))
        elif msg.kind == "tool_result":
            st.pending.append(ContextNote("tool", msg.text, call_id=msg.call_id))
            st.ack_calls.discard(msg.call_id)
            if not st.ack_calls:
                st.ack_due = None
        else:
            prompt = COMMENTARY_PROMPT + msg.text if msg.text else SPEAK_NOW_PROMPT
            st.pending.append(ContextNote("developer", prompt))
            st.pending.append(SpeakRequest())
        if st.reply is None:
            self._flush_context(session, st)
            asked = self._take_speak_request(st)
            if asked is not None:
                self._start_reply(session, st, user_text=None, turn=None, asked=asked)

    def _on_settings(self, session: DuplexSession, st: CascadeSessionState, u: p.UpdateSession) -> None:
        """``UpdateSession`` (the adapter applied its turn-taking already): decoding from the next reply on; new
        instructions once no reply runs (a reply's KV must not change under it)."""
        if u.temperature is not None:
            st.temperature = u.temperature
        if u.max_output_tokens is not None:
            st.max_output_tokens = u.max_output_tokens
        if u.tool_choice is not None:
            st.tool_choice = tool_choice(u.tool_choice)  # checked against the tools by the engine core
        if u.acknowledgement_delay_ms is not None:
            st.ack_delay_ms = u.acknowledgement_delay_ms
        if u.instructions is not None or u.tools is not None:
            tools = tool_specs(u.tools) if u.tools is not None else None
            st.pending.append(InstructionsChange(u.instructions, tools))
            if st.reply is None:
                self._flush_context(session, st)

    def _flush_context(self, session: DuplexSession, st: CascadeSessionState) -> None:
        """Append the waiting context notes to the conversation; speak requests stay queued."""
        for note in st.pending:
            if isinstance(note, ContextNote):
                start = len(self.thinker.log(session.id))
                seg = Segment(
                    Role(note.role),
                    note.text,
                    session.epoch,
                    token_start=start,
                    tool_call=note.call,
                    call_id=note.call_id,
                )
                self.thinker.append(session.id, note.role, self._thinker_text(seg), epoch=session.epoch)
                seg.token_end = len(self.thinker.log(session.id))
                session.log.append(seg)
                if note.transient:
                    st.transient.append(seg)
            elif isinstance(note, TruncateRequest):
                self._truncate(session, note)
            elif isinstance(note, InstructionsChange):
                self._reinstruct(session, st, note)
        st.pending = [x for x in st.pending if isinstance(x, SpeakRequest)]

    def _thinker_text(self, seg: Segment) -> str:
        """What a conversation segment is in the thinker's log: its text, and for an assistant segment that made
        a function call, the call as the model's tool format writes it after the words."""
        if seg.tool_call is None:
            return seg.text
        call = self.thinker.tool_call_text(thinker_call(seg.tool_call))
        return f"{seg.text} {call}" if seg.text else call

    def _reinstruct(
        self, session: DuplexSession, st: CascadeSessionState, change: InstructionsChange
    ) -> None:
        """New instructions or tools become the system segment: the thinker session is re-opened with them and
        the conversation as its history (:func:`~engine_bridge.thinker.turns.reinstruct`: one prefill of the whole
        log, timed in the session stats), and the conversation log's segments are placed on the new token log.
        Instructions the thinker cannot take (too long for its context) leave the old ones, with a non-fatal
        ``SessionError``."""
        thinker = self.thinker
        sid = session.id
        t0 = time.perf_counter()
        previous = st.instructions
        instructions = previous if change.text is None else change.text
        conversation = [seg for seg in session.log if seg.role is not Role.SYSTEM]
        said = [seg for seg in conversation if seg.text or seg.tool_call is not None]
        problem = reinstruct(
            thinker,
            sid,
            instructions,
            [Message(_THINKER_ROLE[seg.role], self._thinker_text(seg)) for seg in said],
            previous=previous,
            examples=self.examples,
            tools=change.tools,
        )
        if not problem:
            st.instructions = instructions
        if problem:
            session.emit(
                p.SessionError(
                    session_id=sid,
                    code="invalid_instructions",
                    message=f"the new instructions were not applied: {problem}",
                    fatal=False,
                )
            )
        opened = thinker.log(sid).segments
        system = [Segment(Role.SYSTEM, opened[0].text, session.epoch, token_start=0, token_end=opened[0].end)]
        # The history is the last segments of the new log (the thinker may have trimmed the oldest turns to fit:
        # those leave the conversation, as a trim does). Empty segments (a reply cut before a word was heard) hold
        # no tokens and stay where they were.
        history = opened[1:]
        kept_said = {id(seg) for seg in said[len(said) - len(history) :]} if history else set()
        first_kept = next(
            (i for i, seg in enumerate(conversation) if id(seg) in kept_said), len(conversation)
        )
        kept: list[Segment] = []
        pos = opened[0].end
        placed = iter(history)
        for i, seg in enumerate(conversation):
            if id(seg) in kept_said:
                tok = next(placed)
                seg.token_start, seg.token_end = tok.start, tok.end
                pos = tok.end
            elif seg.text or seg.tool_call is not None or i < first_kept:
                continue  # trimmed
            else:
                seg.token_start = seg.token_end = pos
            kept.append(seg)
        # One assignment: a stats snapshot taken meanwhile (engine core thread) sees the old or the new log.
        session.log[:] = system + kept
        extra = session.stats.extra
        extra["instructions_rebuilds"] = extra.get("instructions_rebuilds", 0) + 1
        extra["instructions_rebuild_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        extra["instructions_rebuild_tokens"] = len(thinker.log(sid))

    def _truncate(self, session: DuplexSession, req: TruncateRequest) -> None:
        """Keep only ``req.text`` of reply ``req.turn_id``: roll the thinker back to the reply's checkpoint, append
        the kept words, then re-append what followed (one tail rebuild when it is not the last message)."""
        idx = next(
            (
                i
                for i in range(len(session.log) - 1, -1, -1)
                if session.log[i].role is Role.ASSISTANT and session.log[i].turn_id == req.turn_id
            ),
            None,
        )
        if idx is None:
            return
        seg = session.log[idx]
        kept = req.text.strip()
        if len(kept.split()) >= len(seg.text.split()):
            return  # it already holds no more than what was heard
        seg.text, seg.interrupted = kept, True
        self._rebuild_from(session, idx, drop=())
        session.stats.extra["truncations"] = session.stats.extra.get("truncations", 0) + 1

    def _drop_transient(self, session: DuplexSession, st: CascadeSessionState) -> None:
        """The reply is over: its one-time instructions leave the conversation (no reply runs now)."""
        if not st.transient:
            return
        drop = {id(seg) for seg in st.transient}
        st.transient = []
        idx = next((i for i, seg in enumerate(session.log) if id(seg) in drop), None)
        if idx is not None:
            self._rebuild_from(session, idx, drop=drop)

    def _rebuild_from(self, session: DuplexSession, idx: int, *, drop: Collection[int]) -> None:
        """Roll the thinker back to where ``session.log[idx]`` starts and re-append that segment and every later one
        (their current text; segments whose ``id()`` is in ``drop`` leave the conversation)."""
        thinker = self.thinker
        tail = session.log[idx:]
        thinker.rollback(session.id, tail[0].token_start)
        kept: list[Segment] = []
        for seg in tail:
            if id(seg) in drop:
                continue
            seg.token_start = len(thinker.log(session.id))
            if seg.text or seg.tool_call is not None:
                thinker.append(session.id, seg.role.value, self._thinker_text(seg), epoch=seg.epoch)
            seg.token_end = len(thinker.log(session.id))
            kept.append(seg)
        # One slice assignment: a stats snapshot taken meanwhile (engine core thread) sees the old or the new log.
        session.log[idx:] = kept

    @staticmethod
    def _take_speak_request(st: CascadeSessionState) -> SpeakRequest | None:
        """The first queued request for a reply (they coalesce into one reply), or None."""
        asked = next((x for x in st.pending if isinstance(x, SpeakRequest)), None)
        st.pending = [x for x in st.pending if not isinstance(x, SpeakRequest)]
        return asked

    def _decoding(
        self, session: DuplexSession, st: CascadeSessionState, asked: SpeakRequest | None
    ) -> tuple[DecodingSettings, bool]:
        """The reply's decoding: the thinker's spoken-reply default with the session's temperature, the tightest
        token cap in force and the reply's tool choice (its own, else the session's); and whether that cap is the
        client's (a reply stopped by it is ``capped``)."""
        base = self.thinker.session_decoding(session.id)
        cap = (asked.max_output_tokens if asked else 0) or st.max_output_tokens
        client_cap = 0 < cap < base.max_tokens
        changes: dict[str, Any] = {}
        if client_cap:
            changes["max_tokens"] = cap
        if st.temperature is not None:
            changes["temperature"] = st.temperature
        own = asked.tool_choice if asked is not None else None
        choice = tool_choice(own) if own is not None else st.tool_choice
        if choice != base.tool_choice:
            changes["tool_choice"] = choice
        return (dataclasses.replace(base, **changes) if changes else base), client_cap

    # --- replies ------------------------------------------------------------------------------------------------
    def _start_reply(
        self,
        session: DuplexSession,
        st: CascadeSessionState,
        *,
        user_text: str | None,
        turn: CallerTurn | None,
        asked: SpeakRequest | None = None,
    ) -> None:
        thinker = self.thinker
        self._flush_context(session, st)
        log_mark = len(session.log)
        user_ckpt: int | None = None
        append_stats: dict[str, int] = {}
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
            append_stats = {
                "user_tokens": res.new_tokens,
                "prefill_tokens": res.prefill_tokens,
                "cached_tokens": res.cached_tokens,
                "log_before": user_ckpt,
                "trimmed": int(res.trimmed),
            }
        decoding, client_cap = self._decoding(session, st, asked)
        ckpt = thinker.begin_reply(session.id, epoch=session.epoch, decoding=decoding)
        r = self._new_reply(session, st, ckpt.log_len, user_ckpt, log_mark, decoding.temperature)
        r.append_stats, r.client_cap = append_stats, client_cap
        st.reply = r
        st.ack_due = None  # the caller hears a reply: no acknowledgement of an earlier call
        # A speculative reply is not audible: the caller resuming speech discards it, it is no barge-in.
        confirmed = turn is None or turn.phase.confirmed
        r.advance(ReplyPhase.GENERATING if confirmed else ReplyPhase.SPECULATIVE)

    def _new_reply(
        self,
        session: DuplexSession,
        st: CascadeSessionState,
        ckpt_log_len: int,
        user_ckpt: int | None,
        log_mark: int,
        temperature: float,
    ) -> Reply:
        """The next turn's reply, voiced by the session's voice."""
        tts = st.tts or self.tts.tts
        session.turn_id += 1
        session.stats.turns += 1
        return Reply(
            session=session,
            turn_id=session.turn_id,
            epoch=session.epoch,
            ckpt_log_len=ckpt_log_len,
            user_ckpt_log_len=user_ckpt,
            log_mark=log_mark,
            resampler=OutputResampler(tts.sample_rate, ENGINE_OUTPUT_RATE),
            tts=tts,
            voice=st.voice,
            temperature=temperature,
        )

    def _acknowledge(self, session: DuplexSession, st: CascadeSessionState) -> None:
        """Say :data:`ACKNOWLEDGEMENT` as a reply of its own (into the conversation as the assistant's words, so
        the model knows it was said), while a call's result is awaited past the session's delay."""
        st.ack_due = None
        st.ack_calls.clear()
        self._flush_context(session, st)
        ckpt = len(self.thinker.log(session.id))
        self.thinker.append(session.id, "assistant", ACKNOWLEDGEMENT, epoch=session.epoch)
        r = self._new_reply(session, st, ckpt, None, len(session.log), 0.0)
        st.reply = r
        r.advance(ReplyPhase.GENERATING)
        r.text = ACKNOWLEDGEMENT
        r.advance(ReplyPhase.VOICING)
        self._speak(r, ACKNOWLEDGEMENT)
        session.stats.extra["acknowledgements"] = session.stats.extra.get("acknowledgements", 0) + 1

    def _on_barge_in(
        self,
        session: DuplexSession,
        st: CascadeSessionState,
        epoch: int,
        at_ms: int,
        at_wall: float,
        *,
        barge_in: bool,
        heard: HeardUntil = None,
    ) -> None:
        """The fence is up (caller barge-in, or client interrupt when not ``barge_in``): end the reply, keeping
        in the conversation only the words the caller heard (``heard``: the playout when the duck lowered it; what
        played under the duck was not heard)."""
        thinker = self.thinker
        session.epoch = max(session.epoch, epoch)
        r = st.reply
        if r is None:
            return
        st.reply = None
        if r.phase.is_confirmed:
            played = self._played_samples(session, r)
            if heard is not None and heard[:2] == (r.epoch, r.turn_id):
                played = min(played, heard[2])
            committed = " ".join(w.text for w in r.played_words(played)).strip()
            if thinker.is_generating(session.id):
                thinker.end_reply(session.id, committed)
            else:
                thinker.rollback(session.id, r.ckpt_log_len)
                if committed:
                    thinker.append(session.id, "assistant", committed, epoch=r.epoch)
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
                        token_end=len(thinker.log(session.id)),
                        interrupted=True,
                    )
                )
            self._drop_transient(session, st)
            session.stats.barge_ins += 1
            r.advance(
                ReplyPhase.INTERRUPTED,
                cut=Cut(committed, played, (epoch, at_ms) if barge_in else None),
            )
        else:
            # Speculative and unheard: undo it entirely (including the speculative user text).
            self._unwind(session, r)
            st.turn = None
        session.stats.extra["last_barge_in_ms"] = round((time.monotonic() - at_wall) * 1000, 1)
        session.set_state(p.SessionState.USER_SPEAKING)

    @staticmethod
    def _played_samples(session: DuplexSession, r: Reply) -> int:
        """Samples of reply ``r`` that left the server: the media side's playout report for this turn, or,
        when it has not reported any, what was written to egress."""
        epoch, turn_id, played = session.rings.egress.playout()
        if turn_id == r.turn_id and epoch == r.epoch:
            return played
        written = session.written
        return written.samples if written.turn_id == r.turn_id else 0

    # --- model work ---------------------------------------------------------------------------------------------
    @staticmethod
    def voice_busy(sessions: list[tuple[DuplexSession, CascadeSessionState]]) -> bool:
        """True while some caller waits on the pipeline: a turn being transcribed, a reply generating, or a
        reply whose first audio is not out yet. Text requests wait meanwhile (adapters/cascade/text.py)."""
        for _, st in sessions:
            r = st.reply
            if r is None:
                if st.turn is not None:
                    return True
            elif r.phase.is_generating or r.first_audio_wall is None:
                return True
        return False

    def step(self, sessions: list[tuple[DuplexSession, CascadeSessionState]]) -> bool:
        now = time.monotonic()
        generating: list[tuple[DuplexSession, CascadeSessionState, Reply]] = []
        worked = False
        for s, st in sessions:
            r = st.reply
            if r is not None and r.phase.is_generating:
                generating.append((s, st, r))
            elif r is not None:
                worked |= self._maybe_finish(s, st, r)
            elif (
                st.ack_due is not None and now >= st.ack_due and st.turn is None and not st.detector.in_speech
            ):
                self._acknowledge(s, st)
                worked = True
            if now - st.last_usage >= USAGE_EVERY_S:
                st.last_usage = now
                emit_usage(s, self.thinker, self.context_limit)
        if generating:
            outs = self.thinker.step([s.id for s, _, _ in generating])
            for s, _, r in generating:
                self._on_token(s, r, outs[s.id])
            worked = True
        return worked

    def _on_token(self, session: DuplexSession, r: Reply, out: StepOutput) -> None:
        clauses: list[str] = []
        if r.clauses_sent == 0 and early_first_clause_ready(
            r.splitter.pending_text, out.text, self.first_clause_words
        ):
            # Voice the first words now instead of waiting for the end of the sentence: the caller hears the
            # answer start a few tokens earlier, at the cost of a small prosody break after them; never after
            # a word that needs the next one ("The capital of | France" is heard as "Francis").
            clauses += r.splitter.flush()
        if out.token_id is not None:
            r.tokens += 1
        if out.text:
            clauses += r.splitter.push(out.text)
            r.text += out.text
        if out.done:
            r.capped = r.client_cap and out.finish_reason == "length"
            if out.tool_call is not None:
                r.tool_call = call_item(out.tool_call)
            clauses += r.splitter.flush()
            r.advance(ReplyPhase.HELD if r.phase is ReplyPhase.SPECULATIVE else ReplyPhase.VOICING)
            self.thinker.end_reply(session.id, None)
        for clause in clauses:
            self._speak(r, clause)
        if out.done and r.clauses_sent == 0:
            # Nothing speakable came out; the reply is over.
            self._speak(r, "")

    def _speak(self, r: Reply, clause: str) -> None:
        text = clean_for_tts(clause).strip()
        if r.first_clause_wall is None and text:
            r.first_clause_wall = time.monotonic()
        r.clauses_sent += 1
        self.tts.speak(r, text)

    def _maybe_finish(self, session: DuplexSession, st: CascadeSessionState, r: Reply) -> bool:
        """Generation is over; when all clauses are voiced and the audio has left, close the reply."""
        if r.phase is ReplyPhase.VOICING and r.clauses_done >= r.clauses_sent:
            r.advance(ReplyPhase.DRAINING)
        if r.phase is not ReplyPhase.DRAINING:
            return False
        eg = session.rings.egress
        if session.outbox or eg.write_cursor > eg.read_cursor:
            return False
        st.reply = None
        text = r.text.strip()
        session.log.append(
            Segment(
                Role.ASSISTANT,
                text,
                r.epoch,
                turn_id=r.turn_id,
                audio_end_ms=samples_to_ms(r.samples, ENGINE_OUTPUT_RATE),
                token_start=r.ckpt_log_len,
                token_end=len(self.thinker.log(session.id)),
                tool_call=r.tool_call,
            )
        )
        self._drop_transient(session, st)
        # The turn's record and the thinker's figures are in the stats before ReplyDone leaves: a client that asks
        # for stats when it sees ReplyDone gets this turn (the event reaches it while this thread runs on).
        rec = turn_record(r, st.turn)
        if st.turn is not None and st.turn.pause_ms is not None:
            rec["silence_ms"] = st.turn.pause_ms  # the silence that endpointed the caller's turn
        publish_turn(session, st.turn_records, rec, self.thinker)
        r.advance(ReplyPhase.DONE)
        if r.tool_call is not None and st.ack_delay_ms >= 0:
            st.ack_due = time.monotonic() + st.ack_delay_ms / 1000
            st.ack_calls = {r.tool_call.call_id}
        st.turn = None
        self._flush_context(session, st)
        asked = self._take_speak_request(st)
        if asked is not None:
            self._start_reply(session, st, user_text=None, turn=None, asked=asked)
        else:
            session.set_state(
                p.SessionState.USER_SPEAKING if st.detector.in_speech else p.SessionState.LISTENING
            )
        return True
