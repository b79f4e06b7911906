"""The cascade's turn machine and reply lifecycle, driven event by event in milliseconds.

The test plays the engine's other threads by hand: it posts what the audio thread would post (turn start,
speculate, resumed, endpoint, barge-in) or feeds the real webrtcvad turn detector through ``on_audio``; it runs
the ASR and TTS jobs when it chooses (:class:`ManualExecutor`); and it moves queued reply audio into the real
egress ring and plays it out the way the engine's audio thread and the media plane do.

Fakes, and why: :class:`ScriptedTranscriber` and :class:`ScriptedSynthesizer` stand in for whisper and Piper
(seconds per call on this CPU) so the turn machine is testable in milliseconds; they return scripted text and
a fixed tone. The thinker is real: the torch backend on a tiny random-weight Llama with the real SmolLM2
tokenizer (as in tests/test_thinker_contract.py), so KV appends, checkpoints and rollbacks are the real ones.
The real-model path (whisper, SmolLM2, Piper, in an engine process) is tests/test_engine_cascade.py.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from engine_bridge import protocol as p
from engine_bridge.adapters.cascade import CascadeAdapter, CascadeModels
from engine_bridge.adapters.cascade.messages import (
    BargeInHeard,
    Endpoint,
    OverlapCheck,
    Resumed,
    Speculate,
    VadStart,
)
from engine_bridge.adapters.cascade.reply import Cut, Reply
from engine_bridge.adapters.cascade.turns import (
    BACKCHANNEL_MAX_TOKENS,
    BACKCHANNEL_PROMPT,
    SPEAK_NOW_PROMPT,
    BackchannelPolicy,
    CascadeSessionState,
    cascade_state,
)
from engine_bridge.config import DEFAULT_BACKCHANNEL_WORDS, EngineSettings
from engine_bridge.formats import ENGINE_INPUT_RATE, ENGINE_OUTPUT_RATE, INPUT_FRAME_SAMPLES
from engine_bridge.reply import NO_REPLY, TRANSITIONS, IllegalTransition, ReplyPhase
from engine_bridge.ring import RingPair
from engine_bridge.session import DuplexSession, InterruptRequest, TextAppend, TruncateRequest, WrittenAudio
from engine_bridge.speech.asr import DEFAULT_DECODING, Decoding, Transcriber, Word
from engine_bridge.speech.tts import Synthesizer
from engine_bridge.speech.vad import SpeechStopped
from engine_bridge.thinker.base import DecodingSettings
from engine_bridge.thinker.model_store import LoadedModel, build_tiny_random, load_tokenizer
from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig
from livekit_omni.realtime import wire as rt_wire
from livekit_omni.realtime.config import EAGERNESS_END_OF_TURN, RealtimeConfig
from tests.speech_fixtures import silence, voice_like

P = ParamSpec("P")
T = TypeVar("T")

#: Greedy decoding, a few tokens: a random model rarely stops by itself, so every reply has this length.
REPLY_TOKENS = 10
#: Fake TTS output per character of a clause.
TTS_SAMPLES_PER_CHAR = ENGINE_OUTPUT_RATE // 100


# ------------------------------------------------------------------------------------------- fakes
class ScriptedTranscriber(Transcriber):
    """Stands in for whisper: answers each non-silent utterance with the next scripted text."""

    name = "scripted"

    def __init__(self, texts: list[str]) -> None:
        super().__init__()
        self.texts = list(texts)
        #: (prompt, word_times, max_tokens) of every call, in order.
        self.calls: list[tuple[str | None, bool, int | None]] = []

    def _run(
        self,
        pcm: npt.NDArray[np.int16],
        decoding: Decoding = DEFAULT_DECODING,
        window_frames: int | None = None,
    ) -> tuple[str, tuple[Word, ...], bool]:
        self.calls.append((decoding.prompt, decoding.word_times, decoding.max_tokens))
        return (self.texts.pop(0) if self.texts else ""), (), False


class ScriptedSynthesizer(Synthesizer):
    """Stands in for Piper: a 200 Hz tone, 10 ms per character of the clause, in two chunks, at the engine's
    output rate (so the resampler passes it through and sample counts are exact)."""

    name = "scripted"

    @property
    def sample_rate(self) -> int:
        return ENGINE_OUTPUT_RATE

    def synthesize(self, text: str) -> Iterator[npt.NDArray[np.int16]]:
        n = len(text) * TTS_SAMPLES_PER_CHAR
        tone = (np.sin(2 * np.pi * 200 * np.arange(n) / ENGINE_OUTPUT_RATE) * 8000).astype(np.int16)
        yield tone[: n // 2]
        yield tone[n // 2 :]


class ScriptedEndOfTurn:
    """Stands in for the end-of-turn model: a fixed probability per transcript (0: not finished)."""

    name = "scripted"

    def __init__(self, finished: dict[str, float]) -> None:
        self.finished = finished
        self.calls: list[str] = []

    def probability(self, text: str) -> float:
        self.calls.append(text)
        return self.finished.get(text, 0.0)


class ManualExecutor(concurrent.futures.Executor):
    """Queues the worker jobs and runs them only in :meth:`run_all`: the test decides when ASR/TTS finish."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            fut.set_result(fn(*args, **kwargs))

        self.jobs.append(job)
        return fut

    def run_all(self) -> int:
        n = 0
        while self.jobs:
            self.jobs.pop(0)()
            n += 1
        return n


# ------------------------------------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_tiny_random(load_tokenizer(), seed=0)


@dataclass
class Call:
    """One cascade session with the engine's threads played by the test."""

    adapter: CascadeAdapter
    session: DuplexSession
    thinker: TorchThinker
    asr_jobs: ManualExecutor
    tts_jobs: ManualExecutor
    eot_jobs: ManualExecutor
    events: list[p.SessionEvent] = field(default_factory=list)
    played: int = 0
    t_ms: int = 0

    @property
    def st(self) -> CascadeSessionState:
        st = cascade_state(self.session)
        assert st is not None
        return st

    @property
    def reply(self) -> Reply:
        r = self.st.reply
        assert r is not None, "no reply running"
        return r

    def published(self) -> ReplyPhase:
        """The phase of the latest reply as the audio thread sees it (the session's snapshot)."""
        return self.session.reply.phase

    def of(self, kind: type[T]) -> list[T]:
        return [e for e in self.events if isinstance(e, kind)]

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events if not isinstance(e, p.StateChanged | p.Usage)]

    # --- the other threads ------------------------------------------------------------------------------
    def post(self, msg: object) -> None:
        self.session.post(msg)

    def drain(self) -> None:
        """The scheduler thread's mailbox pass."""
        self.handle(self.take_posted())

    def take_posted(self) -> list[object]:
        """Everything posted to the session's mailbox so far (taken out, not handled yet)."""
        posted = []
        while not self.session.mailbox.empty():
            posted.append(self.session.mailbox.get_nowait())
        return posted

    def handle(self, msgs: list[object]) -> None:
        for msg in msgs:
            self.adapter.handle(self.session, msg)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.drain()
            self.adapter.step([self.session])

    def asr(self) -> None:
        self.asr_jobs.run_all()
        self.drain()

    def tts(self) -> None:
        self.tts_jobs.run_all()
        self.drain()

    def eot(self) -> None:
        self.eot_jobs.run_all()
        self.drain()

    def step_until(self, phase: ReplyPhase, *, tts: bool, limit: int = 100) -> None:
        for _ in range(limit):
            if self.reply.phase is phase:
                return
            self.step()
            if tts:
                self.tts()
        raise AssertionError(f"reply never reached {phase.name}; it is {self.reply.phase.name}")

    def write_egress(self) -> None:
        """The audio thread's egress half: move queued reply audio into the ring, counting what was written."""
        s = self.session
        with s.fence_lock:
            while s.outbox:
                c = s.outbox.popleft()
                assert s.rings.egress.write_chunk(c.epoch, c.turn_id, c.seq, c.pcm)
                w = s.written
                s.written = WrittenAudio(
                    c.turn_id, (w.samples if w.turn_id == c.turn_id else 0) + c.pcm.shape[0]
                )

    def play(self) -> int:
        """The media plane: play everything in egress of the current epoch and report the playout position."""
        self.write_egress()
        eg = self.session.rings.egress
        buf = np.zeros(1 << 16, dtype=np.int16)
        n = 0
        while (info := eg.read_chunk(buf)) is not None:
            if info.epoch == eg.epoch:
                self.played += info.nsamples
                n += info.nsamples
                eg.report_playout(info.epoch, info.turn_id, self.played)
        return n

    def finish(self, limit: int = 200) -> p.ReplyDone:
        """Run every thread until the running reply is done (played out)."""
        before = len(self.of(p.ReplyDone))
        for _ in range(limit):
            self.asr()
            self.step()
            self.tts()
            self.play()
            if len(self.of(p.ReplyDone)) > before:
                return self.of(p.ReplyDone)[-1]
        raise AssertionError("the reply never finished")

    def new_reply_played(self) -> None:
        self.played = 0

    # --- what the audio thread posts ----------------------------------------------------------------------
    def caller_speaks(self, ms: int = 1000) -> tuple[int, int]:
        start = self.t_ms + 300
        self.t_ms = start + ms
        self.post(VadStart(start, start + 100))
        return start, self.t_ms

    def speculate(self, start: int, end: int) -> None:
        self.post(Speculate(caller_audio(end - start), start, end, time.monotonic()))

    def endpoint(self, start: int, end: int, *, backchannel: bool = False) -> None:
        ev = SpeechStopped(end_ms=end, at_ms=end + 500, start_ms=start, audio=caller_audio(end - start + 300))
        self.post(Endpoint(ev, time.monotonic(), backchannel))

    def barge_in(self) -> int:
        epoch = self.session.bump_epoch()  # the audio thread raises the fence first
        self.post(BargeInHeard(epoch, self.t_ms, time.monotonic()))
        return epoch

    def interrupt(self) -> int:
        epoch = self.session.bump_epoch()  # the engine core raises the fence first
        self.post(InterruptRequest(epoch))
        return epoch

    def feed(self, pcm: npt.NDArray[np.int16]) -> None:
        """Real caller audio through the real VAD, in 20 ms frames, as the audio thread reads ingress."""
        for i in range(0, pcm.shape[0], INPUT_FRAME_SAMPLES):
            frame = pcm[i : i + INPUT_FRAME_SAMPLES]
            self.session.stats.input_samples += frame.shape[0]
            self.adapter.on_audio(self.session, frame)


def caller_audio(ms: int) -> npt.NDArray[np.int16]:
    return voice_like(ms / 1000, rate=ENGINE_INPUT_RATE)


@pytest.fixture
def make_call(tiny: LoadedModel) -> Iterator[Callable[..., Call]]:
    made: list[Call] = []
    ids = itertools.count()

    def make(
        asr_texts: list[str] | None = None,
        *,
        engine_turn_taking: dict[str, Any] | None = None,
        eot: ScriptedEndOfTurn | None = None,
        **session_overrides: Any,
    ) -> Call:
        thinker = TorchThinker(
            TorchThinkerConfig(
                model="tiny-random", dtype="float32", decoding=DecodingSettings(max_tokens=REPLY_TOKENS)
            ),
            loaded=tiny,
        )
        asr_jobs, tts_jobs, eot_jobs = ManualExecutor(), ManualExecutor(), ManualExecutor()
        models = CascadeModels(
            ScriptedTranscriber(asr_texts or []),
            ScriptedSynthesizer(),
            thinker,
            asr_jobs,
            tts_jobs,
            eot=eot,
            eot_executor=eot_jobs,
        )
        settings = EngineSettings.model_validate(
            {
                "adapter": "cascade",
                "thinker": {"model": "tiny-random"},
                "turn_taking": engine_turn_taking or {},
            }
        )
        adapter = CascadeAdapter(settings, models)
        adapter.load()
        rings = RingPair.create(input_rate=ENGINE_INPUT_RATE, output_rate=ENGINE_OUTPUT_RATE)
        events: list[p.SessionEvent] = []
        config = p.SessionConfig(turn_taking=p.TurnTakingConfig(**session_overrides))
        session = DuplexSession(
            f"sess_turns{next(ids):04d}", rings, config, events.append, owner_id=0, idle_ttl_s=60
        )
        adapter.open(session)
        call = Call(adapter, session, thinker, asr_jobs, tts_jobs, eot_jobs, events)
        made.append(call)
        return call

    yield make
    for call in made:
        call.adapter.close(call.session)
        call.session.rings.close()
        call.session.rings.ingress.unlink()
        call.session.rings.egress.unlink()


def log_len(call: Call) -> int:
    return len(call.thinker.log(call.session.id))


def start_speculation(call: Call) -> tuple[int, int, int]:
    """A caller turn transcribed before its endpoint: returns (start, end, thinker log length before it)."""
    start, end = call.caller_speaks()
    before = log_len(call)
    call.speculate(start, end)
    call.drain()
    call.asr()
    assert call.reply.phase is ReplyPhase.SPECULATIVE
    return start, end, before


def assert_answers_next_turn(call: Call, epoch: int) -> None:
    """After the reply ended, the next caller turn gets a whole answer in the current epoch."""
    start, end = call.caller_speaks()
    call.drain()
    call.endpoint(start, end)
    call.new_reply_played()
    done = call.finish()
    assert not done.interrupted and done.epoch == epoch and done.total_samples > 0


# ------------------------------------------------------------------------------------------- the lifecycle
def test_illegal_transitions_are_refused_and_change_nothing(make_call: Callable[..., Call]) -> None:
    call = make_call()
    call.post(TextAppend("speak_now", "", 0))
    call.drain()
    r = call.reply
    for current, target in itertools.product(ReplyPhase, ReplyPhase):
        if target in TRANSITIONS[current]:
            continue
        r.phase = current  # placed in each phase directly: this checks the table, not the machine
        snapshot, n_events = call.session.reply, len(call.events)
        with pytest.raises(IllegalTransition):
            r.advance(target, cut=Cut("", 0, None) if target is ReplyPhase.INTERRUPTED else None)
        assert r.phase is current and call.session.reply is snapshot and len(call.events) == n_events
    r.phase = ReplyPhase.GENERATING
    with pytest.raises(ValueError):
        r.advance(ReplyPhase.INTERRUPTED)  # an interruption must say what was heard
    with pytest.raises(ValueError):
        r.advance(ReplyPhase.VOICING, cut=Cut("", 0, None))


def test_phase_order_and_table_are_consistent() -> None:
    finished = [ph for ph in ReplyPhase if ph.is_finished]
    assert finished == [ReplyPhase.DONE, ReplyPhase.INTERRUPTED, ReplyPhase.CANCELLED]
    for ph in ReplyPhase:
        assert (not TRANSITIONS[ph]) == ph.is_finished  # finished phases have no exits, the others do
        for nxt in TRANSITIONS[ph]:
            assert nxt > ph  # phases only move forward
        if ph.is_speculative:
            assert (
                not ph.is_confirmed and ReplyPhase.INTERRUPTED not in TRANSITIONS[ph]
            )  # unheard: never "cut"
    assert NO_REPLY.phase.is_finished and NO_REPLY.turn_id == 0


def test_each_transition_publishes_one_snapshot_the_audio_thread_reads(
    make_call: Callable[..., Call],
) -> None:
    call = make_call(["what time is it"])
    s = call.session
    assert s.reply is NO_REPLY and not s.model_audible()
    start, end, _ = start_speculation(call)
    assert call.published() is ReplyPhase.SPECULATIVE and s.reply.turn_id == call.reply.turn_id
    assert not s.model_audible(), "a speculative reply is not audible"
    call.step_until(ReplyPhase.HELD, tts=True)
    assert not s.model_audible() and not s.outbox
    call.endpoint(start, end)
    call.drain()
    assert call.published() is ReplyPhase.VOICING and s.model_audible()
    call.step()
    assert call.published() is ReplyPhase.DRAINING and s.model_audible(), "its audio is still queued"
    call.play()
    assert not s.model_audible(), "played out: nothing produced, queued or in the ring"
    assert call.published() is ReplyPhase.DRAINING
    call.step()
    assert call.published() is ReplyPhase.DONE and not s.model_audible()


# ------------------------------------------------------------------------------------------- speculation
def test_speculation_kept_releases_held_audio_at_the_endpoint(make_call: Callable[..., Call]) -> None:
    call = make_call(["what is the weather like today"])
    start, end, before = start_speculation(call)
    turn_id = call.reply.turn_id
    call.step_until(ReplyPhase.HELD, tts=True)
    # Generated and voiced before the endpoint, and nothing of it left the engine.
    assert call.reply.held and not call.session.outbox
    assert not call.of(p.ReplyStarted) and not call.of(p.OutputTranscript) and not call.of(p.InputTranscript)
    call.endpoint(start, end)
    call.drain()
    assert call.of(p.ReplyStarted)[0].turn_id == turn_id
    assert call.session.outbox and call.of(p.OutputTranscript), "the held audio is released at once"
    done = call.finish()
    assert done.turn_id == turn_id and not done.interrupted
    assert call.played == done.total_samples > 0
    kinds = call.kinds()
    assert kinds.index("SpeechStopped") < kinds.index("InputTranscript") < kinds.index("ReplyStarted")
    assert kinds.index("ReplyStarted") < kinds.index("OutputTranscript") < kinds.index("ReplyDone")
    outs = call.of(p.OutputTranscript)
    assert outs[0].start_sample == 0 and outs[-1].end_sample == done.total_samples
    for a, b in itertools.pairwise(outs):
        assert a.end_sample == b.start_sample
    assert call.of(p.InputTranscript)[0].text == "What is the weather like today?"
    users = [seg for seg in call.session.log if seg.role == "user"]
    assert [u.text for u in users] == ["What is the weather like today?"] and users[0].token_start == before
    record = call.session.stats.extra["turn_records"][-1]
    assert record["speculative"] is True and record["turn_id"] == turn_id
    assert "speculations_discarded" not in call.session.stats.extra


def test_speculation_kept_while_still_generating(make_call: Callable[..., Call]) -> None:
    call = make_call(["tell me a story"])
    start, end, _ = start_speculation(call)
    call.step(2)
    assert call.published() is ReplyPhase.SPECULATIVE
    call.endpoint(start, end)
    call.drain()
    assert call.published() is ReplyPhase.GENERATING and call.of(p.ReplyStarted)
    assert not call.finish().interrupted


def test_speculation_discarded_when_the_caller_goes_on(make_call: Callable[..., Call]) -> None:
    call = make_call(["what is the", "what is the capital of france"])
    start, _, before = start_speculation(call)
    first = call.reply
    call.step(3)
    call.tts()
    call.post(Resumed(call.t_ms))
    call.drain()
    assert first.phase is ReplyPhase.CANCELLED and call.st.reply is None
    assert log_len(call) == before and not call.thinker.is_generating(call.session.id), (
        "KV back before the words"
    )
    assert not call.of(p.ReplyStarted) and not call.of(p.ReplyDone) and not call.session.outbox
    assert call.session.stats.extra["speculations_discarded"] == 1
    # The longer turn is transcribed at its real endpoint and answered at once.
    call.t_ms += 800
    call.endpoint(start, call.t_ms)
    call.drain()
    call.asr()
    second = call.reply
    assert second.phase is ReplyPhase.GENERATING and second.turn_id == first.turn_id + 1
    done = call.finish()
    assert done.turn_id == second.turn_id and not done.interrupted
    assert [seg.text for seg in call.session.log if seg.role == "user"] == ["What is the capital of france?"]
    assert call.session.stats.extra["turn_records"][-1]["speculative"] is False


# ------------------------------------------------------------------------------------------- barge-in
def _reach(call: Call, phase: ReplyPhase) -> None:
    """Put a reply in ``phase``: a speculative one for the speculative phases, a speak-now reply otherwise."""
    if phase.is_speculative:
        start_speculation(call)
        call.step_until(phase, tts=True)
        return
    call.post(TextAppend("speak_now", "", 0))
    call.drain()
    if phase is ReplyPhase.GENERATING:
        while call.reply.clauses_sent == 0:  # until its first clause is out, and part of it played
            call.step()
        call.tts()
        assert call.play() > 0
    elif phase is ReplyPhase.VOICING:
        call.step_until(phase, tts=False)  # the TTS jobs stay queued
        assert call.tts_jobs.jobs
    else:
        call.step_until(ReplyPhase.VOICING, tts=True)
        call.step()
        call.write_egress()  # in the ring, not played yet: what was written stands in for the playout
        assert call.played == 0 and call.session.written.samples == call.reply.samples > 0
    assert call.reply.phase is phase


@pytest.mark.parametrize("how", ["barge_in", "interrupt"])
@pytest.mark.parametrize(
    "phase",
    [ReplyPhase.SPECULATIVE, ReplyPhase.HELD, ReplyPhase.GENERATING, ReplyPhase.VOICING, ReplyPhase.DRAINING],
    ids=lambda ph: ph.name.lower(),
)
def test_barge_in_in_each_phase(make_call: Callable[..., Call], phase: ReplyPhase, how: str) -> None:
    call = make_call(["please book a table for two", "and one more thing"])
    before = log_len(call)
    _reach(call, phase)
    r = call.reply
    # What the caller heard: the media side's playout report, else what was written to egress.
    written = call.session.written
    played = call.played or (written.samples if written.turn_id == r.turn_id else 0)
    n_events = len(call.events)
    epoch = call.barge_in() if how == "barge_in" else call.interrupt()
    call.drain()
    assert call.st.reply is None and not call.session.model_audible()
    assert not call.thinker.is_generating(call.session.id)
    if phase.is_speculative:
        # Never heard: dropped without an event, the caller's words and the reply rolled back.
        assert r.phase is ReplyPhase.CANCELLED
        assert [type(e) for e in call.events[n_events:]] in ([], [p.StateChanged])
        assert log_len(call) == before
    else:
        assert r.phase is ReplyPhase.INTERRUPTED
        done = call.of(p.ReplyDone)[-1]
        assert done.turn_id == r.turn_id and done.interrupted and done.epoch == r.epoch < epoch
        heard = [w.text for w in r.words if w.end_sample <= played]
        assert done.text == " ".join(heard)
        bumps = call.of(p.BargeIn)
        if how == "barge_in":
            assert len(bumps) == 1 and bumps[0].epoch == epoch and bumps[0].played_samples == played
        else:
            assert not bumps, "a client interrupt announces no barge-in"
        # The conversation keeps what was heard, in the log and in the KV alike.
        segs = [seg for seg in call.session.log if seg.role == "assistant" and seg.turn_id == r.turn_id]
        if done.text or r.samples:
            (seg,) = segs
            assert seg.interrupted and seg.text == done.text and seg.token_end == log_len(call)
        else:
            assert not segs and log_len(call) == r.ckpt_log_len, "nothing voiced: the reply leaves no trace"
        # Nothing of the old epoch plays after the fence.
        assert call.play() == 0
    assert call.session.state is p.SessionState.USER_SPEAKING
    assert_answers_next_turn(call, epoch)


# ------------------------------------------------------------------------------------------- the audio thread
def _model_speaking(call: Call) -> Reply:
    call.post(TextAppend("speak_now", "", 0))
    call.drain()
    call.step(2)
    assert call.session.model_audible()
    return call.reply


def test_backchannel_over_model_speech_does_not_cancel(make_call: Callable[..., Call]) -> None:
    call = make_call()
    r = _model_speaking(call)
    epoch = call.session.epoch
    call.feed(np.concatenate([silence(300), caller_audio(80), silence(700)]))  # "mm-hm": under the minimum
    posted = call.take_posted()
    assert [type(m) for m in posted] == [VadStart, Endpoint]
    assert isinstance(posted[1], Endpoint) and posted[1].backchannel
    assert call.session.epoch == epoch == call.session.rings.egress.epoch, "no fence for a backchannel"
    call.handle(posted)
    assert call.session.stats.ignored_short_speech == 1
    assert call.reply is r and r.phase is ReplyPhase.GENERATING
    done = call.finish()
    assert done.turn_id == r.turn_id and not done.interrupted and not call.of(p.BargeIn)


def test_long_speech_over_the_model_barges_in_fence_first(make_call: Callable[..., Call]) -> None:
    call = make_call(["stop"])
    r = _model_speaking(call)
    call.feed(np.concatenate([silence(300), caller_audio(1200)]))
    posted = call.take_posted()
    kinds = [type(m) for m in posted]
    assert kinds[:2] == [VadStart, BargeInHeard], "no speculation or check while it might be a backchannel"
    assert Endpoint not in kinds
    bump = posted[1]
    assert isinstance(bump, BargeInHeard)
    # No pause for a word check: it flushes once it is longer than any backchannel.
    assert bump.at_ms >= 300 + call.adapter.settings.turn_taking.backchannel_max_ms
    assert call.session.rings.egress.epoch == bump.epoch > r.epoch, "the ring's fence was up before the post"
    call.handle(posted)
    assert r.phase is ReplyPhase.INTERRUPTED and call.of(p.BargeIn)[0].turn_id == r.turn_id
    call.feed(silence(700))
    call.drain()
    call.asr()
    assert call.reply.phase is ReplyPhase.GENERATING, "the barging turn is answered"


def test_caller_turn_while_model_silent_speculates_then_endpoints(make_call: Callable[..., Call]) -> None:
    call = make_call(["hello there"])
    call.feed(np.concatenate([silence(300), caller_audio(800), silence(700)]))
    posted = call.take_posted()
    assert [type(m) for m in posted] == [VadStart, Speculate, Endpoint]
    spec, end = posted[1], posted[2]
    assert isinstance(spec, Speculate) and isinstance(end, Endpoint)
    assert not end.backchannel and spec.start_ms == end.ev.start_ms
    call.handle(posted)
    call.asr()
    done = call.finish()
    assert not done.interrupted and call.session.stats.extra["turn_records"][-1]["speculative"] is True


# ------------------------------------------------------------------------------------------- speak-now
def test_speak_now_starts_a_reply_and_queues_behind_a_running_one(make_call: Callable[..., Call]) -> None:
    call = make_call()
    call.post(TextAppend("instructions", "Always be brief.", 0))
    call.drain()
    assert not call.of(p.ReplyStarted) and call.st.reply is None, "instructions alone do not make it speak"
    call.post(TextAppend("speak_now", "", 0))
    call.drain()
    first = call.reply
    assert call.of(p.ReplyStarted)[0].turn_id == first.turn_id and first.phase is ReplyPhase.GENERATING
    assert call.session.state is p.SessionState.THINKING
    call.post(TextAppend("speak_now", "", 0))  # while the first reply runs: it waits
    call.post(TextAppend("commentary", "the oven is hot", 0))
    call.drain()
    assert call.reply is first and len(call.of(p.ReplyStarted)) == 1
    done = call.finish()
    assert done.turn_id == first.turn_id and not done.interrupted
    second = call.reply  # started as soon as the first ended: one reply for both requests
    assert second.turn_id == first.turn_id + 1 and call.of(p.ReplyStarted)[-1].turn_id == second.turn_id
    call.new_reply_played()
    call.finish()
    assert call.st.reply is None and len(call.of(p.ReplyStarted)) == 2
    developer = [seg.text for seg in call.session.log if seg.role == "developer"]
    assert developer[0] == "Always be brief." and developer[1] == SPEAK_NOW_PROMPT
    assert developer[2] == SPEAK_NOW_PROMPT and developer[3].endswith("the oven is hot")
    assert call.session.log[-1].role == "assistant" and call.session.log[-1].turn_id == second.turn_id


def test_closing_mid_reply_cancels_it_without_events(make_call: Callable[..., Call]) -> None:
    call = make_call()
    r = _model_speaking(call)
    n_events = len(call.events)
    call.adapter.close(call.session)
    assert r.phase is ReplyPhase.CANCELLED and len(call.events) == n_events
    call.tts()  # queued TTS work for it voices nothing
    assert not call.session.outbox and r.stale


# ------------------------------------------------------------------------------------------- the Realtime dialect's commands
def test_typed_messages_join_the_conversation_and_respond_answers_them(
    make_call: Callable[..., Call],
) -> None:
    call = make_call()
    call.post(TextAppend("user", "What is the capital of France?", 0))
    call.post(TextAppend("assistant", "Paris.", 0))
    call.drain()
    assert call.st.reply is None and not call.of(p.ReplyStarted), "typed messages alone get no reply"
    roles = [(seg.role, seg.text) for seg in call.session.log[-2:]]
    assert roles == [("user", "What is the capital of France?"), ("assistant", "Paris.")]
    call.post(TextAppend("respond", "", 0))
    call.drain()
    assert call.of(p.ReplyStarted)
    ckpt = call.reply.ckpt_log_len
    done = call.finish()
    # Its usage: the context it came from, all of it already in the KV (nothing new to prefill), and the
    # generated tokens.
    assert done.input_tokens == ckpt > 0 and done.cached_tokens == ckpt
    assert 0 < done.output_tokens <= REPLY_TOKENS
    # respond adds no prompt of its own
    assert not [seg for seg in call.session.log if seg.role == "developer"]


def test_one_time_instructions_leave_the_conversation_when_the_reply_ends(
    make_call: Callable[..., Call],
) -> None:
    call = make_call()
    call.post(TextAppend("user", "hello", 0))
    call.post(TextAppend("respond", "Say goodbye.", 0))
    call.drain()
    assert any(seg.text == "Say goodbye." for seg in call.session.log), "in the context while the reply runs"
    before_reply = call.reply.ckpt_log_len
    done = call.finish()
    texts = [seg.text for seg in call.session.log]
    assert "Say goodbye." not in texts and "hello" in texts
    assert call.session.log[-1].role == "assistant" and call.session.log[-1].turn_id == done.turn_id
    # The token log was rebuilt without them: shorter than it was when the reply started, plus the reply.
    assert log_len(call) == call.session.log[-1].token_end
    assert call.session.log[-1].token_start < before_reply


def test_truncate_reply_keeps_the_words_heard_and_rebuilds_what_followed(
    make_call: Callable[..., Call],
) -> None:
    call = make_call()
    call.post(TextAppend("respond", "", 0))
    call.drain()
    done = call.finish()
    full = call.session.log[-1].text
    assert len(full.split()) > 2
    call.post(TextAppend("user", "and then?", 0))
    call.drain()
    kept = " ".join(full.split()[:2])
    call.post(TruncateRequest(done.turn_id, kept))
    call.drain()
    answer = next(seg for seg in call.session.log if seg.role == "assistant" and seg.turn_id == done.turn_id)
    assert answer.text == kept and answer.interrupted
    assert call.session.log[-1].text == "and then?"  # what followed is still there
    assert log_len(call) == call.session.log[-1].token_end
    # Truncating to more than it holds changes nothing; an unknown turn is ignored.
    n = log_len(call)
    call.post(TruncateRequest(done.turn_id, full))
    call.post(TruncateRequest(999, ""))
    call.drain()
    assert log_len(call) == n and answer.text == kept


def test_auto_reply_off_transcribes_turns_without_replying(make_call: Callable[..., Call]) -> None:
    call = make_call(["what time is it"], auto_reply=False)
    start, end = call.caller_speaks()
    call.drain()
    call.endpoint(start, end)
    call.drain()
    call.asr()
    assert [e.text for e in call.of(p.InputTranscript)] == ["What time is it?"]
    assert call.st.reply is None and not call.of(p.ReplyStarted)
    assert call.session.log[-1].role == "user" and call.session.log[-1].text == "What time is it?"
    call.post(TextAppend("respond", "", 0))
    call.drain()
    assert call.of(p.ReplyStarted)


# ------------------------------------------------------------------------------------------- the barge-in duck
def _feed_watching_gain(call: Call, pcm: npt.NDArray[np.int16]) -> list[tuple[int, float, int]]:
    """Feed 20 ms frames; after each, the media plane's view: (stream ms, the ring's gain word, its epoch)."""
    seen = []
    eg = call.session.rings.egress
    for i in range(0, pcm.shape[0], INPUT_FRAME_SAMPLES):
        call.feed(pcm[i : i + INPUT_FRAME_SAMPLES])
        seen.append(((i + INPUT_FRAME_SAMPLES) // 16, eg.gain, eg.epoch))
    return seen


def test_caller_sound_over_the_model_ducks_it_at_once_and_a_backchannel_restores_it(
    make_call: Callable[..., Call],
) -> None:
    call = make_call()
    _model_speaking(call)
    epoch = call.session.epoch
    tt = call.adapter.settings.turn_taking
    duck_gain = 10 ** (-tt.duck_db / 20)
    seen = _feed_watching_gain(call, np.concatenate([silence(300), caller_audio(80), silence(700)]))
    ducked = [t for t, g, _ in seen if g <= duck_gain + 1e-4]
    assert ducked, seen
    # Ducked at the first 20 ms VAD frame of the sound (it starts at 300 ms), long before any barge-in could.
    assert tt.duck_onset_ms <= 20
    assert ducked[0] == 320 < 300 + tt.barge_in_min_ms
    # The level comes back after the release silence from the VAD's last speech frame, before the turn's
    # endpoint (``silence_ms`` of silence) ...
    (endpoint,) = [m for m in call.take_posted() if isinstance(m, Endpoint)]
    last_voice = endpoint.ev.end_ms
    restored = [t for t, g, _ in seen if t > ducked[0] and g == 1.0]
    assert restored, seen
    assert last_voice + tt.duck_release_ms <= restored[0] <= last_voice + tt.duck_release_ms + 20
    assert restored[0] < last_voice + tt.silence_ms
    # ... with no flush: the model's answer plays on.
    assert all(e == epoch for _, _, e in seen)
    assert call.session.stats.extra["ducks"] == 1 and call.session.stats.extra["duck_releases"] == 1


def test_a_barge_in_lifts_the_duck_only_after_the_epoch_flush(make_call: Callable[..., Call]) -> None:
    call = make_call(["stop"])
    r = _model_speaking(call)
    tt = call.adapter.settings.turn_taking
    seen = _feed_watching_gain(call, np.concatenate([silence(300), caller_audio(1200)]))
    first_duck = next(t for t, g, _ in seen if g < 1.0)
    bump = next(t for t, _, e in seen if e > r.epoch)
    assert first_duck == 320 and bump >= 300 + tt.backchannel_max_ms
    # Ducked from the first frames to the flush; never full level with the old epoch after the duck began.
    assert all(g < 1.0 for t, g, e in seen if first_duck <= t < bump)
    assert not [t for t, g, e in seen if t >= first_duck and g == 1.0 and e == r.epoch]
    assert all(g == 1.0 for t, g, e in seen if t >= bump), "the next reply plays at full level"
    assert "duck_releases" not in call.session.stats.extra  # lifted by the flush, not as a backchannel


def test_caller_speech_while_the_model_is_silent_ducks_nothing(make_call: Callable[..., Call]) -> None:
    call = make_call()
    seen = _feed_watching_gain(call, np.concatenate([silence(300), caller_audio(600), silence(200)]))
    assert all(g == 1.0 for _, g, _ in seen)
    assert "ducks" not in call.session.stats.extra


def _over_model_until_check(call: Call, voice_ms: int = 400) -> tuple[Reply, OverlapCheck, list[object]]:
    """The model speaks; the caller says something short but past the barge-in minimum and pauses: the audio
    thread posts the backchannel check (handled: its ASR job is queued, not run). Returns the reply, the check
    and everything posted."""
    r = _model_speaking(call)
    # WebRTC's hangover keeps ~120 ms after the voice as speech; then the pause (120 ms) posts the check.
    call.feed(np.concatenate([silence(300), caller_audio(voice_ms), silence(300)]))
    posted = call.take_posted()
    assert [type(m) for m in posted] == [VadStart, OverlapCheck], "neither a flush nor a speculation yet"
    check = posted[1]
    assert isinstance(check, OverlapCheck)
    call.handle(posted)
    return r, check, posted


def test_a_backchannel_word_restores_the_level_and_keeps_the_answer(make_call: Callable[..., Call]) -> None:
    call = make_call(["Mm-hm. Mm-hm. M"])  # whisper's repeat, cut by its token bound
    epoch = call.session.epoch
    eg = call.session.rings.egress
    r, check, _ = _over_model_until_check(call)
    assert eg.gain < 1.0, "ducked while the check decides, past the release silence"
    assert check.end_ms < call.st.detector.position_ms and eg.epoch == epoch
    call.asr()
    assert call.asr_jobs.jobs == [] and call.adapter.asr is not None
    transcriber = call.adapter.asr
    assert isinstance(transcriber, ScriptedTranscriber)
    assert transcriber.calls == [(BACKCHANNEL_PROMPT, False, BACKCHANNEL_MAX_TOKENS)], (
        "told to expect backchannels; no word times; only the first words decoded"
    )
    assert eg.gain == 1.0 and eg.epoch == call.session.epoch == epoch, "the level is back, nothing flushed"
    call.feed(silence(600))
    posted = call.take_posted()
    assert [type(m) for m in posted] == [Endpoint]
    end = posted[0]
    assert isinstance(end, Endpoint) and end.backchannel and not end.undecided
    call.handle(posted)
    extra = call.session.stats.extra
    assert extra["backchannels"] == extra["backchannel_checks"] == 1 and extra["duck_releases"] == 1
    assert call.session.stats.ignored_short_speech == 1 and call.reply is r
    done = call.finish()
    assert done.turn_id == r.turn_id and not done.interrupted and not call.of(p.BargeIn)


def test_a_short_real_interruption_flushes_at_the_check_and_is_answered(
    make_call: Callable[..., Call],
) -> None:
    call = make_call(["Wait.", "wait"])
    eg = call.session.rings.egress
    r, check, _ = _over_model_until_check(call)
    assert call.published() is ReplyPhase.GENERATING and eg.epoch == r.epoch
    call.asr()
    assert r.phase is ReplyPhase.INTERRUPTED and eg.epoch > r.epoch and eg.gain == 1.0
    (barge,) = call.of(p.BargeIn)
    assert barge.turn_id == r.turn_id and barge.at_ms == check.end_ms
    # The caller's turn goes on as any barging turn: speculated (no backchannel prompt), endpointed, answered.
    call.feed(silence(600))
    posted = call.take_posted()
    assert [type(m) for m in posted] == [Speculate, Endpoint]
    end = posted[1]
    assert isinstance(end, Endpoint) and not end.backchannel and not end.undecided
    call.handle(posted)
    call.asr()
    assert [e.text for e in call.of(p.InputTranscript)] == ["Wait"]
    assert call.reply.phase is ReplyPhase.GENERATING and call.reply.turn_id > r.turn_id
    assert call.session.stats.ignored_short_speech == 0


@pytest.mark.parametrize(("heard", "interrupts"), [("Stop.", True), ("Yeah.", False)])
def test_an_endpoint_before_the_verdict_waits_for_it(
    make_call: Callable[..., Call], heard: str, interrupts: bool
) -> None:
    call = make_call([heard, "stop"])
    r, _, _ = _over_model_until_check(call)
    call.feed(silence(400))  # the endpoint, while the check's ASR is still out
    posted = call.take_posted()
    assert [type(m) for m in posted] == [Endpoint]
    end = posted[0]
    assert isinstance(end, Endpoint) and end.undecided and not end.backchannel
    call.handle(posted)
    assert not call.of(p.SpeechStopped), "held until the verdict"
    assert call.published() is ReplyPhase.GENERATING and call.session.rings.egress.gain < 1.0
    call.asr()
    assert call.of(p.SpeechStopped) and call.session.rings.egress.gain == 1.0
    if interrupts:
        assert r.phase is ReplyPhase.INTERRUPTED and call.of(p.BargeIn)
        call.asr()  # the turn's own transcript, at its endpoint
        assert [e.text for e in call.of(p.InputTranscript)] == ["Stop"]
        assert call.reply.phase is ReplyPhase.GENERATING and call.reply.turn_id > r.turn_id
    else:
        assert call.reply is r and not call.of(p.BargeIn) and call.session.stats.ignored_short_speech == 1
        assert not call.finish().interrupted


def test_speech_after_a_backchannel_ducks_again_and_is_checked_whole(make_call: Callable[..., Call]) -> None:
    call = make_call(["Yeah.", "Yeah, but why?"])
    eg = call.session.rings.egress
    r, _, _ = _over_model_until_check(call, voice_ms=300)
    call.asr()
    assert eg.gain == 1.0 and call.published() is ReplyPhase.GENERATING
    seen = _feed_watching_gain(call, caller_audio(300))  # "... but why?"
    assert seen[0][1] < 1.0, "ducked again at the first frame"
    call.feed(silence(300))
    posted = call.take_posted()
    assert [type(m) for m in posted] == [OverlapCheck]
    second = posted[0]
    assert isinstance(second, OverlapCheck) and second.start_ms == 300, "the same turn, from its start"
    call.handle(posted)
    call.asr()
    assert r.phase is ReplyPhase.INTERRUPTED and call.of(p.BargeIn)


def test_what_played_under_the_duck_is_not_kept_as_heard(make_call: Callable[..., Call]) -> None:
    call = make_call(["Stop."])
    r = _model_speaking(call)
    for _ in range(50):
        call.step()
        call.tts()
        if call.play():
            break
    heard = call.played
    assert heard > 0
    call.feed(np.concatenate([silence(300), caller_audio(400)]))  # ducked from its first frame
    for _ in range(20):  # the answer goes on under the duck (one more clause)
        call.step()
        call.tts()
        if call.play():
            break
    assert call.played > heard and call.st.reply is r
    call.feed(silence(300))
    call.drain()
    call.asr()
    (barge,) = call.of(p.BargeIn)
    assert barge.turn_id == r.turn_id and barge.played_samples == heard


@pytest.mark.parametrize("settings", [{"duck_db": 0}, {"backchannel_max_ms": 0}])
def test_without_the_duck_or_the_check_the_barge_in_minimum_alone_flushes(
    make_call: Callable[..., Call], settings: dict[str, Any]
) -> None:
    call = make_call(["Mm-hm."], engine_turn_taking=settings)
    r = _model_speaking(call)
    tt = call.adapter.settings.turn_taking
    call.feed(np.concatenate([silence(300), caller_audio(400), silence(200)]))
    posted = call.take_posted()
    assert [type(m) for m in posted][:2] == [VadStart, BargeInHeard] and OverlapCheck not in map(type, posted)
    bump = posted[1]
    assert isinstance(bump, BargeInHeard) and bump.at_ms == 300 + tt.barge_in_min_ms
    call.handle(posted)
    assert r.phase is ReplyPhase.INTERRUPTED


def test_backchannel_words() -> None:
    policy = BackchannelPolicy.from_words(DEFAULT_BACKCHANNEL_WORDS, 1000, 120)
    for text in [
        "Mm-hm.",
        "mm hm",
        "Uh-huh. Uh-huh. Uh-huh",
        "Yeah.",
        "Right. Right. Ri",
        "Okay.",
        "",
        " . . ",
        "Mm- Mm- Mm",  # hums, as whisper writes them
        "M-H-M. M-H-M.",
        "Hm.",
    ]:
        assert policy.is_backchannel(text), text
    for text in [
        "Wait.",
        "Stop.",
        "No.",
        "Hold on.",
        "Yeah, but why?",
        "M-no.",
        "And then make some.",
        "Hmm, wait.",
        "Man.",
        "Come on.",
    ]:
        assert not policy.is_backchannel(text), text
    assert not BackchannelPolicy.from_words([], 1000, 120).is_backchannel("Yeah.")
    assert BackchannelPolicy.from_words([], 1000, 120).is_backchannel(""), "a sound with no words (a cough)"


# ------------------------------------------------------------------------------------------- UpdateSession
def update(call: Call, **fields: Any) -> None:
    """``UpdateSession`` as the engine core applies it (config merged, then the owner's mailbox), then a pass."""
    call.session.apply_update(p.UpdateSession(req_id=1, session_id=call.session.id, **fields))
    call.drain()


def answer(call: Call, *, forget: bool = True, **respond: Any) -> tuple[p.ReplyDone, str]:
    """One reply to the conversation as it stands (``respond``); ``forget``: it leaves the conversation after."""
    call.post(TextAppend("respond", "", 0, **respond))
    call.drain()
    done = call.finish()
    text = call.session.log[-1].text
    if forget:
        call.post(TruncateRequest(done.turn_id, ""))
        call.drain()
    return done, text


def test_new_instructions_rebuild_the_system_segment_keeping_the_conversation(
    make_call: Callable[..., Call],
) -> None:
    call = make_call()
    sid = call.session.id
    call.post(TextAppend("user", "What is the capital of France?", 0))
    call.drain()
    answer(call, forget=False)
    call.post(TextAppend("respond", "", 0))
    call.drain()
    assert call.st.reply is not None
    update(call, instructions="Answer like a pirate.")
    # Deferred while a reply runs (its KV must not change under it).
    assert call.thinker.log(sid).segments[0].text != "Answer like a pirate."
    call.finish()
    segs = call.thinker.log(sid).segments
    assert segs[0].role == "system" and segs[0].text == "Answer like a pirate."
    conversation = [(seg.role, seg.text) for seg in call.session.log if seg.role != "system"]
    assert [r for r, _ in conversation] == ["user", "assistant", "assistant"]
    assert conversation[0][1] == "What is the capital of France?"
    # Exactly the log of a session opened with the new instructions that was told the same conversation.
    call.thinker.open("fresh", "Answer like a pirate.", examples=call.adapter._examples)
    try:
        for role, text in conversation:
            call.thinker.append("fresh", role, text)  # type: ignore[arg-type]
        assert call.thinker.log("fresh").tokens == call.thinker.log(sid).tokens
    finally:
        call.thinker.close("fresh")
    # The engine's conversation log mirrors the thinker's token log segment for segment.
    assert [(s.token_start, s.token_end) for s in call.session.log[1:]] == [
        (seg.start, seg.end) for seg in segs[1:]
    ]
    assert call.session.stats.extra["instructions_rebuilds"] == 1
    assert call.session.stats.extra["settings"]["instructions"] == "Answer like a pirate."


def test_max_output_tokens_caps_the_reply_in_thinker_tokens(make_call: Callable[..., Call]) -> None:
    call = make_call()
    call.post(TextAppend("user", "Tell me a long story.", 0))
    call.drain()
    done, _ = answer(call, max_output_tokens=3)
    assert done.output_tokens == 3 and done.capped
    # A cap the engine's own reply limit is under changes nothing: not capped by the client.
    done, _ = answer(call, max_output_tokens=REPLY_TOKENS + 50)
    assert not done.capped and done.output_tokens <= REPLY_TOKENS
    # The session's cap holds for every reply, a reply's own cap over it.
    update(call, max_output_tokens=4)
    done, _ = answer(call)
    assert done.output_tokens == 4 and done.capped
    done, _ = answer(call, max_output_tokens=2)
    assert done.output_tokens == 2 and done.capped
    assert call.session.stats.extra["turn_records"][-1]["capped"] is True


def test_temperature_makes_replies_sampled_instead_of_greedy(make_call: Callable[..., Call]) -> None:
    call = make_call()
    call.post(TextAppend("user", "hello", 0))
    call.drain()
    greedy = {answer(call)[1] for _ in range(2)}
    assert len(greedy) == 1, "greedy replies to one context are identical"
    update(call, temperature=2.0)
    sampled = {answer(call)[1] for _ in range(3)}
    assert sampled - greedy, (greedy, sampled)
    assert call.session.stats.extra["turn_records"][-1]["temperature"] == 2.0
    assert call.session.stats.extra["settings"]["temperature"] == 2.0


def test_voice_change_voices_the_next_reply_with_that_voice(make_call: Callable[..., Call]) -> None:
    call = make_call()
    answer(call, forget=False)
    assert call.session.stats.extra["turn_records"][-1]["voice"] == "piper"  # the engine's configured TTS
    update(call, voice="en-us")
    call.post(TextAppend("respond", "", 0))
    call.drain()
    r = call.reply
    assert r.voice == "espeak:en-us" and type(r.tts).__name__ == "EspeakSynthesizer"
    done = call.finish()
    assert call.session.stats.extra["turn_records"][-1]["voice"] == "espeak:en-us" and done.total_samples > 0
    # A name that is no installed voice (the dialects' "marin") is the engine's default voice.
    update(call, voice="marin")
    call.post(TextAppend("respond", "", 0))
    call.drain()
    assert call.reply.voice == "piper" and call.reply.tts is call.adapter.tts
    call.finish()


def test_turn_taking_update_changes_the_silence_window_of_the_next_turn(
    make_call: Callable[..., Call],
) -> None:
    call = make_call(["one", "two"], silence_ms=300)

    def endpoint_wait_ms() -> int:
        """Silence (ms) the detector waited before it ended a turn."""
        call.feed(np.concatenate([silence(300), caller_audio(800), silence(1500)]))
        ends = [m for m in call.take_posted() if isinstance(m, Endpoint)]
        assert len(ends) == 1, ends
        return ends[0].ev.at_ms - ends[0].ev.end_ms

    assert abs(endpoint_wait_ms() - 300) <= 60
    update(call, turn_taking=p.TurnTakingConfig(silence_ms=900, auto_reply=False, barge_in_min_ms=10_000))
    assert abs(endpoint_wait_ms() - 900) <= 60
    settings = call.session.stats.extra["settings"]
    assert settings["silence_ms"] == 900 and settings["auto_reply"] is False and call.st.speculative_ms == 0
    assert call.st.barge_in_min_ms == 10_000  # the audio thread's barge-in minimum (interrupt_response false)


def test_instructions_too_long_for_the_context_leave_the_old_ones(make_call: Callable[..., Call]) -> None:
    call = make_call()
    sid = call.session.id
    call.post(TextAppend("user", "hello", 0))
    call.drain()
    before = call.thinker.log(sid).tokens
    update(call, instructions="word " * 5000)
    errors = call.of(p.SessionError)
    assert [e.code for e in errors] == ["invalid_instructions"] and not errors[0].fatal
    assert call.thinker.log(sid).tokens == before  # the same log, rebuilt
    assert [seg.text for seg in call.session.log if seg.role == "user"] == ["hello"]


# ------------------------------------------------------------------------------------------- end of turn
def test_a_finished_sentence_ends_the_turn_without_waiting_for_the_longest_wait(
    make_call: Callable[..., Call],
) -> None:
    eot = ScriptedEndOfTurn({"What is the capital of France?": 0.9})
    call = make_call(
        ["What is the capital of France?"], eot=eot, engine_turn_taking={"eot_max_wait_ms": 2000}
    )
    assert call.st.eot.enabled and call.st.detector.settings.silence_ms == 2000
    call.feed(np.concatenate([silence(300), caller_audio(800), silence(200)]))
    call.handle(call.take_posted())
    call.asr()  # the speculation's transcript goes to the end-of-turn model
    assert len(call.eot_jobs.jobs) == 1 and not call.of(p.SpeechStopped)
    call.eot()
    assert eot.calls == ["What is the capital of France?"]
    call.feed(silence(40))  # the audio thread's next chunk ends the turn in this pause
    ends = [m for m in call.take_posted() if isinstance(m, Endpoint)]
    assert len(ends) == 1
    waited = ends[0].ev.at_ms - ends[0].ev.end_ms
    assert waited < 300, f"the turn ended after {waited} ms of silence, not at once"
    call.handle(ends)
    done = call.finish()
    assert not done.interrupted and call.session.stats.extra["turn_records"][-1]["silence_ms"] == waited
    assert call.session.stats.extra["eot_finished"] == 1


def test_an_unfinished_sentence_waits_for_the_longest_wait(make_call: Callable[..., Call]) -> None:
    eot = ScriptedEndOfTurn({})
    call = make_call(["What is the"], eot=eot, engine_turn_taking={"eot_max_wait_ms": 1200})
    call.feed(np.concatenate([silence(300), caller_audio(800), silence(200)]))
    call.handle(call.take_posted())
    call.asr()
    call.eot()
    call.feed(silence(900))
    assert not [m for m in call.take_posted() if isinstance(m, Endpoint)], "ended before the longest wait"
    call.feed(silence(400))
    ends = [m for m in call.take_posted() if isinstance(m, Endpoint)]
    assert len(ends) == 1 and abs(ends[0].ev.at_ms - ends[0].ev.end_ms - 1200) <= 40


def test_a_question_with_a_pause_is_one_turn_transcribed_whole_and_answered_once(
    make_call: Callable[..., Call],
) -> None:
    whole = "What is the capital of France?"
    asr = ["What is the capital?", whole]
    eot = ScriptedEndOfTurn({whole: 0.9})
    call = make_call(asr, eot=eot, engine_turn_taking={"eot_max_wait_ms": 2000})
    transcriber = call.adapter.asr
    assert isinstance(transcriber, ScriptedTranscriber)
    heard: list[int] = []
    real_run = transcriber._run

    def run(
        pcm: npt.NDArray[np.int16], decoding: Decoding = DEFAULT_DECODING, window_frames: int | None = None
    ) -> tuple[str, tuple[Word, ...], bool]:
        heard.append(pcm.shape[0] * 1000 // ENGINE_INPUT_RATE)
        return real_run(pcm, decoding, window_frames)

    transcriber._run = run  # type: ignore[method-assign]
    posted: list[object] = []

    def feed(pcm: npt.NDArray[np.int16]) -> None:
        call.feed(pcm)
        msgs = call.take_posted()
        posted.extend(msgs)
        call.handle(msgs)
        call.asr()
        call.eot()
        call.step()

    feed(np.concatenate([silence(300), caller_audio(800)]))
    for _ in range(
        10
    ):  # a 1 s pause, 100 ms at a time: the model hears the first half and finds it unfinished
        feed(silence(100))
    assert not call.of(p.SpeechStopped), "the pause ended the turn"
    assert eot.calls == ["What is the capital?"]
    assert call.reply.phase is ReplyPhase.SPECULATIVE, "a reply is prepared in the pause, held"
    assert call.played == 0 and call.play() == 0, "nothing heard before the turn is judged ended"
    feed(caller_audio(600))  # the caller goes on: the speculation is discarded
    assert call.st.reply is None
    feed(silence(200))
    feed(silence(40))
    assert [type(m) for m in posted].count(Endpoint) == 1
    assert heard[-1] >= 300 + 800 + 1000 + 600, (
        f"the second transcript heard {heard[-1]} ms, not the whole turn"
    )
    done = call.finish()
    assert not done.interrupted
    assert [e.text for e in call.of(p.InputTranscript)] == [whole]
    assert len(call.of(p.SpeechStopped)) == 1 and len(call.of(p.ReplyDone)) == 1
    users = [seg.text for seg in call.session.log if seg.role.value == "user"]
    assert users == [whole], users


@pytest.mark.parametrize("eagerness", ["high", "low"])
def test_semantic_vad_eagerness_changes_the_wait(make_call: Callable[..., Call], eagerness: str) -> None:
    """The Realtime dialect's semantic_vad: the eagerness picks the model's threshold and the longest wait for an
    unfinished sentence (here the model finds every pause unfinished)."""
    td = rt_wire.TurnDetection(type="semantic_vad", eagerness=eagerness)
    cfg = RealtimeConfig(model="m").apply(
        rt_wire.SessionConfig(audio=rt_wire.AudioConfig(input=rt_wire.AudioInput(turn_detection=td)))
    )
    tt = cfg.turn_taking()
    threshold, max_wait = EAGERNESS_END_OF_TURN[eagerness]
    assert (tt.end_of_turn, tt.eot_threshold, tt.eot_max_wait_ms) == ("model", threshold, max_wait)
    overrides = {k: v for k, v in msgspec.structs.asdict(tt).items() if v is not None}
    call = make_call(["What is the"], eot=ScriptedEndOfTurn({}), **overrides)
    assert call.st.eot.threshold == threshold
    call.feed(np.concatenate([silence(300), caller_audio(800), silence(200)]))
    call.handle(call.take_posted())
    call.asr()
    call.eot()
    call.feed(silence(max_wait + 200))
    ends = [m for m in call.take_posted() if isinstance(m, Endpoint)]
    assert len(ends) == 1 and abs(ends[0].ev.at_ms - ends[0].ev.end_ms - max_wait) <= 40


def test_server_vad_ends_turns_by_silence_alone(make_call: Callable[..., Call]) -> None:
    eot = ScriptedEndOfTurn({"hello": 0.9})
    call = make_call(["hello"], eot=eot, end_of_turn="silence", silence_ms=500)
    assert not call.st.eot.enabled and call.st.detector.settings.silence_ms == 500
    call.feed(np.concatenate([silence(300), caller_audio(800), silence(700)]))
    call.handle(call.take_posted())
    call.asr()
    assert eot.calls == [] and len(call.of(p.SpeechStopped)) == 1
