"""The duplex session engine on the embedded CPU pipeline (real VAD, whisper, SmolLM2, Piper), in a real engine
process, fed through the shared-memory rings by a driver that behaves like the media plane (tests/engine_driver.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import pytest
import soxr

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from engine_bridge.control import EngineRequestError
from engine_bridge.formats import ENGINE_OUTPUT_RATE
from engine_bridge.speech.asr import WhisperTranscriber
from engine_bridge.speech.text import normalize_text
from tests.conftest import connect_engine, spawn_engine
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import noise_burst, speech_bounds_ms, synthesize_speech

pytestmark = pytest.mark.models


#: The module's engine process (the `engine` and `client` fixtures of tests/conftest.py).
ENGINE_SETTINGS = {"adapter": "cascade", "max_sessions": 3, "idle_ttl_s": 60}


@pytest.fixture(scope="module")
def asr() -> WhisperTranscriber:
    return WhisperTranscriber()


def transcribe_reply(asr: WhisperTranscriber, pcm24k: np.ndarray) -> str:
    return normalize_text(
        asr.transcribe(soxr.resample(pcm24k, ENGINE_OUTPUT_RATE, 16000).astype(np.int16)).text
    )


async def ask(driver: SessionDriver, text: str, *, timeout: float = 30.0) -> int:
    """Speak ``text`` and play until the reply that follows it is done; returns its turn id."""
    before = len(driver.of(p.ReplyDone))
    await driver.run(
        synthesize_speech(text, lead_silence_ms=300, tail_silence_ms=0),
        seconds=0,
        until=lambda d: len(d.of(p.ReplyDone)) > before,
    )
    done = driver.of(p.ReplyDone)[before]
    return done.turn_id


async def test_spoken_question_gets_paris_with_consistent_timelines(
    client: EngineClient, asr: WhisperTranscriber
) -> None:
    session = await client.open_session()
    d = SessionDriver(session)
    question = synthesize_speech("What is the capital of France?", lead_silence_ms=500, tail_silence_ms=0)
    await asyncio.wait_for(d.run(question, until=lambda d: d.reply_done()), 40)
    await d.run(seconds=0.3)
    reply = d.of(p.ReplyDone)[0]
    audio = d.audio_of_turn(reply.turn_id)
    assert audio.shape[0] > ENGINE_OUTPUT_RATE // 2, "expected at least half a second of reply audio"
    heard = transcribe_reply(asr, audio)
    assert "paris" in heard, heard
    # Input transcript: the caller's words, placed where the speech is in the ingress audio.
    inputs = d.of(p.InputTranscript)
    assert len(inputs) == 1 and inputs[0].final
    assert "capital" in normalize_text(inputs[0].text) and "france" in normalize_text(inputs[0].text)
    speech_start_ms = 500
    speech_end_ms = question.shape[0] * 1000 // 16000
    assert speech_start_ms - 350 <= inputs[0].start_ms <= speech_start_ms + 150
    assert speech_end_ms - 300 <= inputs[0].end_ms <= speech_end_ms + 100
    assert d.of(p.SpeechStarted)[0].at_ms == inputs[0].start_ms
    # Output transcript: word by word, on the reply's sample timeline, covering the audio without gaps.
    outs = [e for e in d.of(p.OutputTranscript) if e.turn_id == reply.turn_id]
    assert "paris" in normalize_text("".join(e.text for e in outs))
    assert outs[0].start_sample == 0
    for a, b in itertools.pairwise(outs):
        assert a.end_sample == b.start_sample and b.end_sample > b.start_sample
    assert outs[-1].end_sample == reply.total_samples == audio.shape[0]
    # Event order on the session timeline.
    kinds = [type(e).__name__ for _, e in d.events if not isinstance(e, p.StateChanged | p.Usage)]
    assert kinds.index("SpeechStarted") < kinds.index("SpeechStopped") < kinds.index("ReplyStarted")
    assert kinds.index("InputTranscript") < kinds.index("ReplyDone")
    await session.close()


def audible(text: str) -> np.ndarray:
    """Piper speaking ``text``, cut at its first and last audible sample."""
    pcm = synthesize_speech(text, lead_silence_ms=0, tail_silence_ms=0)
    start_ms, end_ms = speech_bounds_ms(pcm, 16000)
    return pcm[start_ms * 16 : end_ms * 16]


async def test_a_question_with_a_one_second_pause_is_answered_once_as_one_turn(
    client: EngineClient, asr: WhisperTranscriber
) -> None:
    """The end-of-turn model (the engine's default): a finished question ends the turn well before the longest
    wait; a question with a 1 s pause in the middle stays one turn, transcribed whole and answered once."""
    session = await client.open_session()
    d = SessionDriver(session)
    await asyncio.wait_for(
        d.run(audible("What is the capital of Italy?"), until=lambda d: d.reply_done()), 40
    )
    stats = await session.stats()
    assert stats.extra["settings"]["end_of_turn"] == "model"
    assert stats.extra["endpoint_pause_ms"] < stats.extra["settings"]["eot_max_wait_ms"] - 500, stats.extra
    await d.run(seconds=1.0)
    stopped, done = len(d.of(p.SpeechStopped)), len(d.of(p.ReplyDone))
    gap = np.zeros(16000, np.int16)
    paused = np.concatenate([audible("What is the capital"), gap, audible("of France?")])
    await asyncio.wait_for(d.run(paused, until=lambda d: len(d.of(p.ReplyDone)) > done), 60)
    await d.run(seconds=1.0)
    assert len(d.of(p.SpeechStopped)) == stopped + 1, "the pause ended the turn"
    said = normalize_text(d.of(p.InputTranscript)[-1].text)
    assert "capital" in said and "france" in said, said
    replies = d.of(p.ReplyDone)[done:]
    assert len(replies) == 1 and not replies[0].interrupted
    assert "paris" in transcribe_reply(asr, d.audio_of_turn(replies[0].turn_id))
    users = [seg.text for seg in (await session.stats()).log if seg.role == "user"]
    assert len(users) == 2 and "france" in normalize_text(users[1]), users
    await session.close()


async def test_three_turns_use_the_kv_lease_and_prefill_only_new_tokens(client: EngineClient) -> None:
    session = await client.open_session()
    d = SessionDriver(session)
    await ask(d, "Hello, my name is Alice.")
    await ask(d, "What is the capital of France?")
    await ask(d, "What is my name?")
    # The answers, greedy from SmolLM2-135M: turn 2 is a fact it knows. Turn 3 it answers in its own voice ("my
    # name is Emily"): a model this small does not resolve "my" to the caller, so only that it answered the name
    # question is asserted; that turn 1's name is in turn 3's context is what the token log checks below show.
    answers = [normalize_text(e.text) for e in d.of(p.ReplyDone)]
    assert len(answers) == 3 and all(answers), answers
    assert "paris" in answers[1], answers
    assert "name" in answers[2], answers
    stats = await session.stats()
    records = stats.extra["turn_records"]
    assert len(records) == 3
    log = stats.log
    users = [seg for seg in log if seg.role == "user"]
    assistants = [seg for seg in log if seg.role == "assistant"]
    assert len(users) == 3 and len(assistants) == 3
    assert "alice" in normalize_text(users[0].text)
    # Turn 3's prompt holds turn 1 (the name) in the leased KV: the token log is one contiguous conversation.
    for prev, nxt in itertools.pairwise(log):
        assert nxt.token_start == prev.token_end, log
    for rec in records[1:]:
        # Only the new user message was prefilled; everything before it came from the kept cache.
        assert rec["prefill_tokens"] == rec["user_tokens"], rec
        assert rec["cached_tokens"] == rec["log_before"], rec
        assert rec["prefill_tokens"] < 0.5 * rec["log_before"], rec
    assert stats.extra["thinker"]["trims"] == 0
    await session.close()


async def test_barge_in_stops_stale_audio_keeps_played_part_and_answers_next(client: EngineClient) -> None:
    session = await client.open_session()
    d = SessionDriver(session)
    # A long reply: ask the model to speak now with a long text to say.
    await session.append_text(
        "commentary",
        "Tell the caller this whole story: the old lighthouse keeper climbed the stairs every evening, lit the "
        "great lamp, watched the ships pass through the storm, and wrote their names in his book until dawn.",
    )
    await d.run(seconds=0, until=lambda d: d.played_seconds() > 1.5)
    reply_turn = d.of(p.ReplyStarted)[0].turn_id
    interrupt = synthesize_speech(
        "Wait, stop. What is the capital of France?", lead_silence_ms=0, tail_silence_ms=0
    )
    await asyncio.wait_for(
        d.run(interrupt, until=lambda d: any(e.turn_id > reply_turn for e in d.of(p.ReplyDone))), 60
    )
    bump = d.of(p.BargeIn)
    assert len(bump) == 1 and bump[0].turn_id == reply_turn
    new_epoch = bump[0].epoch
    assert d.epoch_changes and d.epoch_changes[0][1] == new_epoch
    t_bump = d.epoch_changes[0][0]
    # No stale-epoch audio after the fence went up.
    stale_after = [pl for pl in d.played if pl.wall > t_bump and pl.epoch < new_epoch]
    assert not stale_after
    done = next(e for e in d.of(p.ReplyDone) if e.turn_id == reply_turn)
    assert done.interrupted
    played = d.audio_of_turn(reply_turn).shape[0]
    # The reply was cut: the engine had synthesized more of it than the caller heard, and that rest never played.
    assert 0 < played < done.total_samples, (played, done.total_samples)
    stats = await session.stats()
    seg = next(s for s in stats.log if s.role == "assistant" and s.turn_id == reply_turn)
    assert seg.interrupted
    # Only the played words were kept: each kept word's audio ended within what was played.
    outs = [e for e in d.of(p.OutputTranscript) if e.turn_id == reply_turn]
    kept = [e.text.strip() for e in outs if e.end_sample <= bump[0].played_samples]
    assert seg.text.split() == kept
    assert len(kept) < len(outs), "words past the cut were synthesized and must have been dropped"
    assert bump[0].played_samples <= played + 480
    assert seg.audio_end_ms <= played * 1000 // ENGINE_OUTPUT_RATE + 20
    full_story_words = 34
    assert len(kept) < full_story_words
    # The next answer follows, in the new epoch.
    nxt = next(e for e in d.of(p.ReplyDone) if e.turn_id > reply_turn)
    assert nxt.epoch == new_epoch and not nxt.interrupted
    assert d.audio_of_turn(nxt.turn_id).shape[0] > 0
    await session.close()


async def test_short_sounds_do_not_interrupt(client: EngineClient) -> None:
    session = await client.open_session()
    d = SessionDriver(session)
    await session.append_text(
        "commentary", "Tell the caller a two sentence fact about the moon and the tides."
    )
    await d.run(seconds=0, until=lambda d: d.played_seconds() > 0.8)
    assert not d.reply_done(), "the reply ended before the noise burst: nothing was tested"
    turn = d.of(p.ReplyStarted)[0].turn_id
    burst_start = time.monotonic()
    await d.run(noise_burst(ms=120, level_db=-12), seconds=1.0)
    burst_end = burst_start + 0.12
    await asyncio.wait_for(d.run(seconds=0, until=lambda d: d.reply_done()), 60)
    assert not d.of(p.BargeIn)
    done_at, done = d.timed(p.ReplyDone)[0]
    assert not done.interrupted and done.turn_id == turn
    # The reply was playing when the burst came and went on playing through it: its audio was played during
    # the burst and after it, and it finished after the burst.
    during = [pl for pl in d.played if pl.turn_id == turn and burst_start <= pl.wall <= burst_end]
    after = [pl for pl in d.played if pl.turn_id == turn and pl.wall > burst_end + 0.2]
    assert during and after and done_at > burst_end + 0.2
    assert any(np.abs(pl.pcm).max() > 500 for pl in during + after), (
        "the reply's audio after 0.8 s was silent"
    )
    await session.close()


async def test_text_into_the_conversation_and_speak_now(client: EngineClient) -> None:
    session = await client.open_session(
        p.SessionConfig(instructions="You are a friendly assistant for a bakery.")
    )
    d = SessionDriver(session)
    r1 = await session.append_text("instructions", "Always mention that the bakery opens at eight.")
    assert r1.start_ms == r1.end_ms
    await session.append_text("thinking", "The caller's name is Bob.")
    await d.run(seconds=0.5)
    assert not d.of(p.ReplyStarted), "instructions and silent context must not make the model speak"
    await session.append_text("speak_now", "")
    await asyncio.wait_for(d.run(seconds=0, until=lambda d: d.reply_done()), 60)
    assert d.audio_of_turn(d.of(p.ReplyDone)[0].turn_id).shape[0] > 0
    # The reply draws on both kinds of context: the caller's name from the silent "thinking" text, the bakery from
    # the instructions. (The opening hour, the later instruction, SmolLM2-135M leaves out: not asserted.)
    reply = normalize_text(d.of(p.ReplyDone)[0].text)
    assert "bob" in reply and "bakery" in reply, reply
    stats = await session.stats()
    roles = [s.role for s in stats.log]
    assert roles.count("developer") >= 3 and roles[-1] == "assistant"
    await session.close()


async def test_session_limit_typed_error_fast(client: EngineClient) -> None:
    sessions = [await client.open_session() for _ in range(3)]
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(EngineRequestError) as e:
        await client.open_session()
    assert e.value.code == "session_limit_reached"
    assert asyncio.get_running_loop().time() - t0 < 2.0
    for s in sessions:
        await s.close()


async def test_idle_session_reaped_and_kv_released(client: EngineClient) -> None:
    base = (await client.ping()).details["kv_bytes"]
    session = await client.open_session(p.SessionConfig(idle_ttl_s=1.5))
    await session.append_text("thinking", "Remember the number forty two.")
    assert (await client.ping()).details["kv_bytes"] > base
    closed = await asyncio.wait_for(_wait_closed(session), 15)
    assert closed.reason == "idle_timeout"
    info = await client.ping()
    assert info.details["kv_bytes"] == base and info.active_sessions == 0


async def _wait_closed(session) -> p.SessionClosed:
    async for ev in session.iter_events():
        if isinstance(ev, p.SessionClosed):
            return ev
    raise AssertionError("no SessionClosed")


async def test_past_the_context_limit_the_session_keeps_answering() -> None:
    # Short replies (8 tokens, a couple of seconds of speech each) reach the limit in the same number of turns
    # without a minute of audio: what is tested is the trim, not the length of what is said.
    eng = spawn_engine(
        adapter="cascade", thinker={"max_model_len": 320, "max_reply_tokens": 8, "long_reply_tokens": 8}
    )
    try:
        client = await connect_engine(eng)
        session = await client.open_session()
        d = SessionDriver(session)
        for i in range(8):
            await session.append_text(
                "thinking", f"Fact {i}: the river number {i} flows north past {i + 3} old mills."
            )
            await session.append_text("speak_now", "")
            await asyncio.wait_for(d.run(seconds=0, until=lambda d, n=i: len(d.of(p.ReplyDone)) > n), 60)
        turn = await ask(d, "What is the capital of France?")
        assert d.audio_of_turn(turn).shape[0] > 0
        stats = await session.stats()
        assert stats.extra["thinker"]["trims"] >= 1
        assert stats.extra["thinker"]["resident_kv_tokens"] <= 320
        assert stats.log[0].role == "system"
        assert (await client.ping()).state is p.EngineState.READY
        await session.close()
        await client.close()
    finally:
        eng.stop()
