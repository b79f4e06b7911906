"""ASR on real Piper speech: faster-whisper tiny.en (its fitted encoder window, the default, and the full 30 s one)
and pocketsphinx, each loaded once for the module."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from engine_bridge.speech.asr import (
    OFFSET_TAIL_MS,
    ONSET_LEAD_MS,
    PocketsphinxTranscriber,
    Transcriber,
    Transcript,
    WhisperTranscriber,
    Word,
    has_phantom_tail,
    is_repetition_loop,
    make_transcriber,
    speech_span,
)
from engine_bridge.speech.text import text_words, tidy_transcript
from tests.speech_fixtures import add_noise, noise, silence, speech_bounds_ms, synthesize_speech

pytestmark = pytest.mark.models

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def whisper() -> Transcriber:
    t = make_transcriber("whisper", threads=1)
    t.warmup()
    return t


@pytest.fixture(scope="module")
def whisper_full() -> WhisperTranscriber:
    t = WhisperTranscriber(threads=1, window="full")
    t.warmup()
    return t


@pytest.fixture(scope="module")
def sphinx() -> Transcriber:
    return make_transcriber("pocketsphinx", threads=1)


@pytest.fixture(scope="module")
def question() -> npt.NDArray[np.int16]:
    # Shaped like what the VAD hands over: 300 ms prefix padding, 200 ms tail, low background noise.
    return synthesize_speech(QUESTION, lead_silence_ms=300, tail_silence_ms=200, noise_db=-50.0)


def test_whisper_transcribes_the_question(whisper: Transcriber, question: npt.NDArray[np.int16]) -> None:
    assert isinstance(whisper, WhisperTranscriber) and whisper.name == "whisper"
    result = whisper.transcribe(question)
    words = text_words(result.text)
    assert "capital" in words and "france" in words, result.text
    assert result.audio_ms == len(question) * 1000 // 16_000
    assert result.elapsed_ms > 0
    # Word times are measured, ordered, and inside the audio.
    assert result.word_timing_measured and len(result.words) >= 5
    starts = [w.start_ms for w in result.words]
    assert starts == sorted(starts)
    for w in result.words:
        assert 0 <= w.start_ms <= w.end_ms <= result.audio_ms + 50
    print(f"whisper: {result.text!r} in {result.elapsed_ms:.0f} ms for {result.audio_ms} ms of audio")


@pytest.mark.parametrize(
    "text",
    [QUESTION, "My name is Alice. What is the capital of France?", "How many legs does a spider have?"],
)
def test_fitted_window_hears_a_spoken_question_as_the_full_window_does(
    whisper: Transcriber, whisper_full: WhisperTranscriber, text: str
) -> None:
    assert isinstance(whisper, WhisperTranscriber) and whisper.window == "fit"
    pcm = synthesize_speech(text, lead_silence_ms=300, tail_silence_ms=200, noise_db=-50.0)
    fit, full = whisper.transcribe(pcm), whisper_full.transcribe(pcm)
    assert text_words(fit.text) == text_words(full.text), (fit.text, full.text)
    # Every word that carries the question is heard (tiny.en may swap an article: "a spider" -> "the spider").
    assert {w for w in text_words(text) if len(w) > 3} <= set(text_words(fit.text)), fit.text
    # The fitted encoder saw the utterance from its onset lead on plus 3 s of padding; the full one whisper's 30 s.
    assert full.window_ms == 30_000
    focused, offset = whisper.focus(pcm)
    span = speech_span(pcm)
    assert span is not None and offset == span[0] - ONSET_LEAD_MS * 16
    assert len(focused) == span[1] + OFFSET_TAIL_MS * 16 - offset
    focused_ms = len(focused) * 1000 // 16_000
    assert focused_ms + 3_000 <= fit.window_ms <= focused_ms + 3_030
    # Word times are measured in both, and agree to within whisper's 20 ms token grid plus a little.
    assert fit.word_timing_measured and len(fit.words) == len(full.words)
    for a, b in zip(fit.words, full.words, strict=True):
        assert abs(a.start_ms - b.start_ms) <= 200 and abs(a.end_ms - b.end_ms) <= 200, (a, b)
    print(f"{text!r}: fit {fit.elapsed_ms:.0f} ms, full {full.elapsed_ms:.0f} ms")


@pytest.mark.parametrize("noise_db", [None, -50.0, -40.0])
def test_where_the_vad_cuts_the_turn_does_not_change_what_whisper_gets(
    whisper: Transcriber, noise_db: float | None
) -> None:
    """The VAD cuts a turn on its 30 ms frames, so from call to call the speech starts and ends a little earlier
    or later in the segment. Cut as it came, tiny.en heard "France" as "friends" with the speech 120-220 ms into a
    clean segment and right at 0-100 and 240-400 ms, and on the WebRTC track at most cuts (docs/speech-stack.md).
    Whisper gets the segment from ONSET_LEAD_MS before the speech to OFFSET_TAIL_MS after it, so every cut of the
    same stream, 20 to 400 ms before the speech and 30 to 300 ms after it, is the same audio."""
    assert isinstance(whisper, WhisperTranscriber) and whisper.onset_lead_ms == ONSET_LEAD_MS
    stream = synthesize_speech(QUESTION, lead_silence_ms=500, tail_silence_ms=300, noise_db=noise_db)
    speech_ms, end_ms = speech_bounds_ms(
        synthesize_speech(QUESTION, lead_silence_ms=500, tail_silence_ms=300)
    )
    focused = []
    for i, lead_ms in enumerate(range(20, 401, 20)):
        cut_at = (speech_ms - lead_ms) * 16
        pcm, offset = whisper.focus(stream[cut_at : (end_ms + (30, 100, 200, 300)[i % 4]) * 16])
        focused.append((cut_at + offset, pcm))
    # The same samples from the same place in the stream (noise, whose quiet floor each cut measures a little
    # differently, moves the span's ends by a few samples, well under 1 ms).
    starts = [start for start, _ in focused]
    assert max(starts) - min(starts) <= 16, starts
    lengths = [len(pcm) for _, pcm in focused]
    assert max(lengths) - min(lengths) <= 16, lengths
    span = speech_span(stream)
    assert span is not None and abs(min(starts) + ONSET_LEAD_MS * 16 - span[0]) <= 16
    assert abs(lengths[0] - (span[1] - span[0] + (ONSET_LEAD_MS + OFFSET_TAIL_MS) * 16)) <= 16
    # ... heard as asked, from a cut that used to be heard "friends" and from one 20 ms before the speech, whose
    # lead is made up with silence.
    for lead_ms in (20, 160):
        heard = whisper.transcribe(stream[(speech_ms - lead_ms) * 16 :])
        assert text_words(heard.text) == text_words(QUESTION), (lead_ms, heard.text)
        # Word times are those of the audio handed over, not of the snapped segment (the last word's end: whisper
        # puts the first word's start near the start of the segment, before the speech).
        assert abs(heard.words[-1].end_ms - (end_ms - speech_ms + lead_ms)) <= 150, (lead_ms, heard.words)


def test_a_segment_in_loud_noise_is_handed_over_as_cut(whisper: Transcriber) -> None:
    """Under -30 dBFS of noise no bar tells where the speech starts: the segment goes to whisper as cut."""
    assert isinstance(whisper, WhisperTranscriber)
    pcm = synthesize_speech(QUESTION, lead_silence_ms=300, tail_silence_ms=200, noise_db=-30.0)
    assert speech_span(pcm) is None
    focused, offset = whisper.focus(pcm)
    assert offset == 0 and focused is pcm


def test_fitted_window_is_what_the_encoder_gets(
    whisper: Transcriber, question: npt.NDArray[np.int16]
) -> None:
    assert isinstance(whisper, WhisperTranscriber)
    frames = whisper.window_frames(len(whisper.focus(question)[0]))
    assert frames % 2 == 0 and frames < 3000
    whisper.transcribe(question)
    # The encoder (CTranslate2, stride-2 convolution) turns the frames it is given into half as many states:
    # handed the padded 30 s segment faster-whisper builds, it encodes only the fitted window.
    model = whisper._model
    assert model.encoder_frames == frames
    states = model.encode(np.zeros((80, 3000), dtype=np.float32))
    assert list(states.shape)[:2] == [1, frames // 2]
    # An utterance of 27 s or more gets the whole window, as does every utterance in ``full`` mode.
    assert whisper.window_frames(27 * 16_000) == 3000
    assert whisper.window_frames(60 * 16_000) == 3000


def test_whisper_latency_on_a_two_second_utterance(whisper: Transcriber) -> None:
    pcm = synthesize_speech("Set a timer for ten minutes.", lead_silence_ms=300, tail_silence_ms=200)
    assert 1500 <= len(pcm) * 1000 // 16_000 <= 3000
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        result = whisper.transcribe(pcm)
        times.append(time.perf_counter() - t0)
    assert "timer" in text_words(result.text), result.text
    best = min(times)
    print(f"whisper tiny.en int8, 1 thread: best {best:.2f} s for {len(pcm) / 16_000:.2f} s of audio")
    # ~0.15 s on a quiet CPU with the fitted window (~0.5 s with the full one); the bound only catches a broken configuration (beam search, fallback, fp32).
    assert best < 2.5


def test_pocketsphinx_gives_words_with_times(sphinx: Transcriber, question: npt.NDArray[np.int16]) -> None:
    assert isinstance(sphinx, PocketsphinxTranscriber) and sphinx.name == "pocketsphinx"
    result = sphinx.transcribe(question)
    assert text_words(result.text), result
    assert result.word_timing_measured
    # The words as heard; the text is tidied (tidy_transcript: case and the question mark only).
    assert text_words(" ".join(w.text for w in result.words)) == text_words(result.text)
    for w in result.words:
        assert 0 <= w.start_ms < w.end_ms <= result.audio_ms + 20
    print(f"pocketsphinx: {result.text!r} in {result.elapsed_ms:.0f} ms")


@pytest.mark.parametrize("which", ["whisper", "sphinx"])
def test_silence_and_noise_give_empty_text(which: str, request: pytest.FixtureRequest) -> None:
    asr: Transcriber = request.getfixturevalue(which)
    # Digital silence, no audio and a too-short click are answered by the gate, before the model runs
    # (elapsed_ms stays 0: nothing was decoded).
    for pcm in (silence(1000), np.zeros(0, dtype=np.int16), noise(50, -20.0)):
        result = asr.transcribe(pcm)
        assert result == Transcript(text="", audio_ms=len(pcm) * 1000 // 16_000)
        assert result.is_empty and result.elapsed_ms == 0
    # A second of noise passes the gate, so the model itself decodes it and must find no words (whisper answers
    # low noise with a bare ". . ." segment; pocketsphinx with fillers such as <sil> and [NOISE]; neither may come
    # out as text). Loud noise only for pocketsphinx: whisper tiny.en hears "You" in -20 dBFS white noise, which
    # the VAD never hands it.
    for level_db in (-50.0,) if which == "whisper" else (-50.0, -20.0):
        pcm = noise(1000, level_db, seed=0)
        assert np.abs(pcm.astype(np.int32)).max() > 100  # louder than the silence gate's peak
        result = asr.transcribe(pcm)
        assert result.elapsed_ms > 0, "the model never ran: the silence gate answered"
        assert result.text == "" and result.words == (), (level_db, result)


def as_the_vad_hands_it(text: str) -> npt.NDArray[np.int16]:
    """``text`` spoken, cut to its audible samples, with the engine's 300 ms of prefix padding before and the 270 ms
    of silence its endpointer waits after: the clip whisper gets for a turn."""
    pcm = synthesize_speech(text, rate=16_000, lead_silence_ms=0, tail_silence_ms=0)
    start_ms, end_ms = speech_bounds_ms(pcm, 16_000)
    return np.concatenate([silence(300), pcm[start_ms * 16 : end_ms * 16], silence(270)])


def test_a_short_word_after_a_pause_is_heard(whisper: Transcriber) -> None:
    """The caller's second turn of ``benchmarks/endpointing.py``'s 900 ms control, exactly as the engine handed it
    to whisper (300 ms of prefix padding, "planet?", 270 ms of silence): the timestamped decode once gave no segment
    at all (the turn went unanswered), and in a 4 s fitted window "Planet... Planet..."; heard once, it is right."""
    result = whisper.transcribe(as_the_vad_hands_it("planet?"))
    assert text_words(result.text) == ["planet"], result
    assert result.words


SHORT_REPLIES = [
    "yes",
    "no",
    "Paris.",
    "okay",
    "Thanks.",
    "Hello?",
    "What is it?",
    "Why?",
    "Right.",
    "Alice.",
]


@pytest.mark.parametrize("noise_db", [None, -50.0])
def test_short_replies_are_heard_once_not_in_a_loop(whisper: Transcriber, noise_db: float | None) -> None:
    """One- to three-word turns as the VAD hands them over. In a fitted 4 s window whisper tiny.en looped on most
    of them ("Paris Paris Paris Paris ..."); short clips get a 15 s window."""
    looped, missed = [], []
    for text in SHORT_REPLIES:
        clip = as_the_vad_hands_it(text)
        if noise_db is not None:
            clip = add_noise(clip, noise_db, seed=1)
        heard = whisper.transcribe(clip).text
        if is_repetition_loop(heard) or len(text_words(heard)) > len(text_words(text)) + 1:
            looped.append(heard)
        if text_words(text)[-1] not in text_words(heard):
            missed.append((text, heard))
    assert not looped, looped
    # tiny.en's own mishearings of a lone word ("Why?" as "Y") are not what this test is about: allow one.
    assert len(missed) <= 1, missed


def _fitted_decode_says(
    whisper: WhisperTranscriber,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    words: list[tuple[str, float, float]],
) -> None:
    """Whether tiny.en loops or appends words on a given clip in the fitted window depends on the CPU's int8
    kernels ("yes" looped on an AVX-512 VM and not on an AVX2 one), so the fitted decode's output is set here:
    a stand-in for that one decode only; the 30 s window's decode stays the real model's."""
    from faster_whisper.transcribe import Segment
    from faster_whisper.transcribe import Word as FwWord

    model = whisper._model
    real = model.transcribe

    def transcribe(audio: Any, **kw: Any) -> Any:
        if model.encoder_frames >= 3000:
            return real(audio, **kw)
        fw = [FwWord(start=a, end=b, word=f" {w}", probability=0.5) for w, a, b in words]
        seg = Segment(0, 0, 0.0, words[-1][2], text, [], -0.5, 1.0, 0.1, fw, 0.0)
        return iter([seg]), None

    monkeypatch.setattr(model, "transcribe", transcribe)


@pytest.mark.parametrize(
    ("fitted_text", "fitted_words"),
    [
        # A loop, as tiny.en decoded "yes" in a 4 s window on an AVX-512 VM.
        ("Yes. Yes. Yes. Yes. Yes. Yes", [("Yes.", 0.0 + i * 0.4, 0.3 + i * 0.4) for i in range(6)]),
        # A phantom tail, as it decoded "What is it?" under noise on an AVX2 VM (the repeat at 0.98-0.98 s).
        (
            "Yes. What is it?",
            [("Yes.", 0.0, 0.5), ("What", 0.98, 0.98), ("is", 0.98, 0.98), ("it?", 0.98, 0.98)],
        ),
    ],
    ids=["loop", "phantom-tail"],
)
def test_a_degenerate_decode_in_a_fitted_window_is_decoded_again_in_the_full_one(
    whisper: Transcriber,
    monkeypatch: pytest.MonkeyPatch,
    fitted_text: str,
    fitted_words: list[tuple[str, float, float]],
) -> None:
    assert isinstance(whisper, WhisperTranscriber)
    clip = as_the_vad_hands_it("yes")
    # A clip that does not loop is decoded once, in its own window (the real model, nothing set).
    whisper.transcribe(clip)
    assert whisper._model.encoder_frames == whisper.window_frames(len(whisper.focus(clip)[0])) < 3000
    _fitted_decode_says(whisper, monkeypatch, fitted_text, fitted_words)
    heard = whisper.transcribe(clip)
    # The encoder's last window shows that the guard decoded again in whisper's own 30 s window.
    assert whisper._model.encoder_frames == 3000, "no second decode: the degenerate one was kept"
    assert text_words(heard.text) == ["yes"], heard.text
    assert not has_phantom_tail(heard.words)


def test_phantom_tails_are_told_from_short_words() -> None:
    assert has_phantom_tail((Word("What", 0, 460), Word("it?", 980, 980)))
    assert not has_phantom_tail((Word("Yes.", 0, 500),))
    assert not has_phantom_tail((Word("a", 500, 520),))  # one 20 ms alignment step is a word
    assert not has_phantom_tail(())


def test_repetition_loops_are_told_from_speech() -> None:
    for text in (
        "Yes. Yes. Yes.",
        "Paris Paris Paris Paris",
        "What is it? What is it? What is it",
        "Y, Y, Y, Y,",
    ):
        assert is_repetition_loop(text), text
    for text in (
        "no no",
        "Tell me more.",
        "Yes please, yes please.",
        "",
        "Right. Right.",
        "one two three one two",
    ):
        assert not is_repetition_loop(text), text


def test_rejects_non_int16(whisper: Transcriber) -> None:
    with pytest.raises(TypeError):
        whisper.transcribe(np.zeros(16_000, dtype=np.float32))  # type: ignore[arg-type]


def test_one_instance_serves_two_threads(sphinx: Transcriber, question: npt.NDArray[np.int16]) -> None:
    expected = sphinx.transcribe(question).text
    results: list[str] = []

    def work() -> None:
        results.append(sphinx.transcribe(question).text)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [expected, expected]


def test_factory_names() -> None:
    with pytest.raises(ValueError, match="unknown transcriber"):
        make_transcriber("vosk", threads=1)
    with pytest.raises(ValueError):
        WhisperTranscriber(threads=0)
    with pytest.raises(ValueError, match="window"):
        WhisperTranscriber(window="half")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("heard", "tidy"),
    [
        ("which planet is farthest from the sun.", "Which planet is farthest from the sun?"),
        ("How many legs does a spider have.", "How many legs does a spider have?"),
        ("What is 3.5 plus 2.", "What is 3.5 plus 2?"),
        ("I went home. where should I go.", "I went home. where should I go?"),
        ("what is the capital of france", "What is the capital of france?"),  # pocketsphinx: no punctuation
        ("What is the capital of France?", "What is the capital of France?"),
        ("What a day.", "What a day."),
        ("Tell me what you think.", "Tell me what you think."),
        ("Whatever.", "Whatever."),
        ("hello there", "Hello there"),
        ("  ", ""),
    ],
)
def test_transcripts_read_as_the_question_that_was_asked(heard: str, tidy: str) -> None:
    assert tidy_transcript(heard) == tidy
    assert text_words(tidy_transcript(heard)) == text_words(heard)


def test_the_transcript_a_recogniser_returns_is_tidied(
    sphinx: Transcriber, question: npt.NDArray[np.int16]
) -> None:
    """pocketsphinx gives bare lower-case words; the transcript starts upper-case and a question ends in "?"."""
    text = sphinx.transcribe(question).text
    assert text[:1].isupper() and text.endswith("?"), text
