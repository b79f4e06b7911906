"""Spoken exchanges in the OpenAI Realtime dialect with the REAL engine (cascade: VAD → ASR → SmolLM2 → Piper).

The embedded models are needed: turns, transcripts, replies and barge-in come from them (the loopback fixture has
none of these). The clients are stock ones: the openai SDK's ``client.realtime.connect()`` and LiveKit's
``openai.realtime.RealtimeModel`` inside a real ``AgentSession`` (in-memory audio, tests/plugin_harness.py). The
caller's speech is Piper-synthesized (tests/speech_fixtures.py). Every server event the SDK tests receive is
validated against the SDK's ``RealtimeServerEvent`` union in strict mode (tests/realtime_checks.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from livekit.agents import Agent, AgentSession
from livekit.plugins.openai.realtime import RealtimeModel

from engine_bridge import protocol as p
from engine_bridge.client import EngineClient
from tests.conftest import ServerProcess, start_server
from tests.plugin_harness import Mic, Speaker, history_messages, wait_until, words
from tests.realtime_checks import ServerEventLog
from tests.realtime_sdk import API_KEY, INSTRUCTIONS, sdk_caller
from tests.speech_fixtures import synthesize_speech

pytestmark = pytest.mark.models

QUESTION = "What is the capital of France?"
STORYTELLER = "You are a storyteller. Always answer at length, in many sentences."


@pytest.fixture(scope="module")
def cascade_server() -> Iterator[ServerProcess]:
    s = start_server(adapter="cascade", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])})
    yield s
    s.stop()


async def engine_log(server: ServerProcess, session_id: str) -> list[p.LogEntry]:
    client = await EngineClient.connect("unix:" + server.socket_path)
    try:
        return (await client.session_stats(session_id)).log
    finally:
        await client.close()


async def engine_log_when(
    server: ServerProcess, session_id: str, cond: Any, timeout: float = 10.0
) -> list[p.LogEntry]:
    """The engine's conversation log once ``cond(log)`` holds: the engine applies truncates and removals on its
    scheduler thread, after the command's reply. Fails with the last log if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        log = await engine_log(server, session_id)
        if cond(log) or time.monotonic() > deadline:
            assert cond(log), [(e.role, e.text, e.interrupted) for e in log]
            return log
        await asyncio.sleep(0.2)


def response_order_ok(types: list[str], response_events: list[str]) -> None:
    """Within one response: created first, done last, output item before any delta."""
    assert response_events[0] == "response.created" and response_events[-1] == "response.done", (
        response_events
    )
    first_delta = next((i for i, t in enumerate(response_events) if t.endswith(".delta")), None)
    if first_delta is not None:
        assert response_events.index("response.output_item.added") < first_delta


def events_of(log: ServerEventLog, response_id: str) -> list[str]:
    return [
        e["type"]
        for e in log.events
        if e.get("response_id") == response_id or (e.get("response") or {}).get("id") == response_id
    ]


async def test_openai_sdk_realtime_spoken_exchange(cascade_server: ServerProcess) -> None:
    """A spoken question under server VAD gets the whole GA event sequence and a spoken answer; every event
    validates against the SDK's union."""
    async with sdk_caller(
        cascade_server, {"audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"}}}}
    ) as c:
        c.say(QUESTION)
        started = await c.until("input_audio_buffer.speech_started")
        stopped = await c.until("input_audio_buffer.speech_stopped", item_id=started["item_id"])
        assert stopped["audio_end_ms"] > started["audio_start_ms"] >= 0
        await c.until("input_audio_buffer.committed", item_id=started["item_id"])
        transcript = await c.until(
            "conversation.item.input_audio_transcription.completed", item_id=started["item_id"]
        )
        assert "capital" in transcript["transcript"].lower(), transcript
        done = await c.until("response.done", 60)
        rid = done["response"]["id"]
    resp = done["response"]
    assert resp["status"] == "completed", resp
    answer = resp["output"][0]["content"][0]["transcript"]
    assert "paris" in answer.lower(), answer
    usage = resp["usage"]
    # Tokens from the engine: the reply's context, the part of it the KV lease reused (the system prompt at
    # least: only the caller's words were prefilled), and what it generated.
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0
    assert 0 < usage["input_token_details"]["cached_tokens"] < usage["input_tokens"], usage
    response_order_ok(c.log.types(), events_of(c.log, rid))
    # Its audio came before response.done, and the transcript deltas add up to the final transcript.
    assert len(c.audio.get(rid, b"")) > 24000 * 2 * 0.5
    deltas = "".join(
        e["delta"] for e in c.log.of("response.output_audio_transcript.delta") if e["response_id"] == rid
    )
    assert " ".join(deltas.split()) == " ".join(answer.split())
    # The user item was added before its transcript; the assistant item's previous item is the user's.
    added = [e for e in c.log.of("conversation.item.added")]
    assert added[0]["item"]["id"] == started["item_id"]
    assert added[1]["previous_item_id"] == started["item_id"]


async def test_manual_mode_commit_then_response_create(cascade_server: ServerProcess) -> None:
    """``turn_detection: null``: no VAD events; commit gives the item and its transcript but no response; an
    explicit ``response.create`` answers it, echoing its metadata, with text only when asked."""
    async with sdk_caller(
        cascade_server,
        {"audio": {"input": {"turn_detection": None, "transcription": {"model": "whisper-1"}}}},
        mic=False,
    ) as c:
        await c.conn.input_audio_buffer.commit()
        err = await c.until("error")
        assert err["error"]["code"] == "input_audio_buffer_commit_empty"
        await c.conn.send(
            {
                "type": "input_audio_buffer.append",
                "audio": base64.b64encode(
                    synthesize_speech(QUESTION, rate=24000).astype("<i2").tobytes()
                ).decode(),
            }
        )
        await c.conn.input_audio_buffer.commit()
        committed = await c.until("input_audio_buffer.committed")
        transcript = await c.until("conversation.item.input_audio_transcription.completed", 30)
        assert transcript["item_id"] == committed["item_id"] and "capital" in transcript["transcript"].lower()
        await asyncio.sleep(2.0)
        assert not c.log.of("response.created"), "a commit in manual mode must not start a response"
        await c.conn.response.create(response={"output_modalities": ["text"], "metadata": {"turn": "1"}})
        done = await c.until("response.done", 60)
    assert not c.log.of("input_audio_buffer.speech_started")
    resp = done["response"]
    assert resp["metadata"] == {"turn": "1"} and resp["status"] == "completed", resp
    text = resp["output"][0]["content"][0]["text"]
    assert "paris" in text.lower(), resp
    rid = resp["id"]
    assert rid not in c.audio, "a text-only response sends no audio"
    assert "response.output_text.delta" in events_of(c.log, rid)


async def test_barge_in_cancels_and_truncate_keeps_words_heard(cascade_server: ServerProcess) -> None:
    """Speaking over a long answer: the server cancels it (``turn_detected``) and tolerates the client's racing
    ``response.cancel``; truncates (beyond the audio, fractional, t = 0, late) are clamped, never refused; the
    engine's conversation holds only the words that were sent."""
    async with sdk_caller(cascade_server, {}, instructions=STORYTELLER) as c:
        sid = c.log.events[0]["session"]["id"]
        c.say("Tell me a long story about a dragon and a knight.")
        first = await c.until("response.output_audio_transcript.delta", 60)
        rid = first["response_id"]
        t_end = time.monotonic() + 2.0  # let it speak a while
        while time.monotonic() < t_end:
            await c.next(30)
        assert not any(e["type"] == "response.done" for e in c.log.events), "the answer ended too soon"
        c.say("Stop. What is the capital of France?")
        done = await c.logged(lambda e: e["type"] == "response.done" and e["response"]["id"] == rid, 30)
        assert c.log.of("input_audio_buffer.speech_started")[-1]
        assert done["response"]["status"] == "cancelled", done
        assert done["response"]["status_details"]["reason"] == "turn_detected"
        item = done["response"]["output"][0]
        # A racing cancel: a non-fatal error that clients know, and the session goes on.
        await c.conn.send({"type": "response.cancel", "event_id": "racing"})
        err = await c.until("error")
        assert err["error"]["code"] == "response_cancel_not_active" and err["error"]["event_id"] == "racing"
        heard_ms = len(c.audio[rid]) // 2 * 1000 // 24000
        # Beyond the audio: clamped to it.
        await c.conn.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item["id"],
                "content_index": 0,
                "audio_end_ms": 10**7,
            }
        )
        t = await c.until("conversation.item.truncated")
        assert abs(t["audio_end_ms"] - heard_ms) <= 100, (t, heard_ms)
        # Fractional: floored.
        await c.conn.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item["id"],
                "content_index": 0,
                "audio_end_ms": 1500.7,
            }
        )
        t = await c.until("conversation.item.truncated")
        assert t["audio_end_ms"] == 1500
        await c.conn.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
        got = await c.until("conversation.item.retrieved")
        kept_1500 = got["item"]["content"][0]["transcript"]
        # The whole words that ended by 1.5 s: a prefix of the answer (how many depends on the speech's pace).
        full_words = words(item["content"][0]["transcript"])
        assert words(kept_1500) == full_words[: len(words(kept_1500))], (kept_1500, item)
        # The next answer (to the barge-in question) comes; a late truncate of the old item still works.
        nxt = await c.logged(lambda e: e["type"] == "response.done" and e["response"]["id"] != rid, 60)
        assert "paris" in nxt["response"]["output"][0]["content"][0]["transcript"].lower(), nxt
        # The engine's conversation holds the truncated answer (the truncate waited for the running reply).
        await engine_log_when(
            cascade_server,
            sid,
            lambda log: (
                words(next(e for e in log if e.role == "assistant" and e.interrupted).text)
                == words(kept_1500)
            ),
        )
        await c.conn.send(
            {
                "type": "conversation.item.truncate",
                "item_id": item["id"],
                "content_index": 0,
                "audio_end_ms": 0,
            }
        )
        t = await c.until("conversation.item.truncated")
        assert t["audio_end_ms"] == 0
        await c.conn.send({"type": "conversation.item.retrieve", "item_id": item["id"]})
        assert (await c.until("conversation.item.retrieved"))["item"]["content"][0]["transcript"] == ""
        # Deleting the interrupted item; then it is gone.
        await c.conn.send({"type": "conversation.item.delete", "item_id": item["id"]})
        assert (await c.until("conversation.item.deleted"))["item_id"] == item["id"]
        await c.conn.send({"type": "conversation.item.retrieve", "item_id": item["id"], "event_id": "gone"})
        err = await c.until("error")
        assert err["error"]["code"] == "item_retrieve_invalid_item_id"
        after = await engine_log_when(
            cascade_server,
            sid,
            lambda log: next(e for e in log if e.role == "assistant" and e.interrupted).text == "",
        )
    sent = " ".join(
        e["delta"] for e in c.log.of("response.output_audio_transcript.delta") if e["response_id"] == rid
    )
    # Words kept after the barge-in were all sent; the late truncate to 0 emptied the cut answer and kept
    # everything after it (the question and its answer: a tail rebuild).
    assert set(words(kept_1500)) <= set(words(sent)), (kept_1500, sent)
    first_cut = next(e for e in after if e.role == "assistant" and e.interrupted)
    assert first_cut.text == "", [(e.role, e.text) for e in after]
    later = after[after.index(first_cut) + 1 :]
    assert any(e.role == "user" and "capital" in e.text.lower() for e in later), later
    assert any(e.role == "assistant" and "paris" in e.text.lower() for e in later), later


# --- LiveKit's stock RealtimeModel ------------------------------------------------------------------------------


async def test_livekit_realtime_model_two_turns_and_generate_reply(cascade_server: ServerProcess) -> None:
    """Stock ``RealtimeModel(base_url=<server>/v1, api_key=...)`` (semantic_vad, transcription, tools defaults) in
    an AgentSession: two spoken turns are answered, then ``generate_reply()`` speaks."""
    model = RealtimeModel(base_url=f"{cascade_server.url}/v1", api_key=API_KEY)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(24000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    errors: list[Any] = []
    session.on("error", errors.append)
    try:
        await session.start(agent=Agent(instructions=INSTRUCTIONS))
        for n, question in enumerate([QUESTION, "How many legs does a spider have?"], 1):
            await mic.say(synthesize_speech(question, rate=24000))
            await wait_until(lambda n=n: len(history_messages(session, "user")) >= n, 40, f"user message {n}")
            await wait_until(
                lambda n=n: len([m for m in history_messages(session, "assistant") if m.strip()]) >= n,
                60,
                f"assistant message {n}",
            )
            await asyncio.sleep(2.0)
        before = len([m for m in history_messages(session, "assistant") if m.strip()])
        handle = session.generate_reply(instructions="Say goodbye to the caller.")
        await asyncio.wait_for(handle, 60)
        await wait_until(
            lambda: len([m for m in history_messages(session, "assistant") if m.strip()]) > before,
            30,
            "the generated reply",
        )
    finally:
        await session.aclose()
        await model.aclose()
    users = history_messages(session, "user")
    assistants = [m for m in history_messages(session, "assistant") if m.strip()]
    assert "capital" in users[0].lower() and "spider" in users[1].lower(), users
    assert any("paris" in m.lower() for m in assistants), assistants
    assert speaker.played > 1.0
    assert not errors, errors


async def test_livekit_realtime_model_barge_in_truncates_the_answer(cascade_server: ServerProcess) -> None:
    """Speaking over a long answer with stock ``RealtimeModel``: LiveKit's history holds the answer cut short
    (marked interrupted), and the engine's conversation holds only words that were sent to the client (with
    this in-memory speaker, sent = heard)."""
    model = RealtimeModel(base_url=f"{cascade_server.url}/v1", api_key=API_KEY)
    session = AgentSession(llm=model, aec_warmup_duration=None)
    mic, speaker = Mic(24000), Speaker()
    session.input.audio, session.output.audio = mic, speaker
    raw = ServerEventLog()
    try:
        await session.start(agent=Agent(instructions=STORYTELLER))
        session.current_agent.realtime_llm_session.on("openai_server_event_received", raw.add)
        await mic.say(synthesize_speech("Tell me a long story about a dragon and a knight.", rate=24000))
        await wait_until(lambda: speaker.pushed > 2.5, 60, "2.5 s of the story")
        await mic.say(synthesize_speech("Stop. What is the capital of France?", rate=24000))
        await wait_until(
            lambda: bool(_interrupted(session)), 30, "the interrupted answer in LiveKit's history"
        )
        await wait_until(
            lambda: any("paris" in m.lower() for m in history_messages(session, "assistant")),
            60,
            "the next answer",
        )
        sid = next(
            e["session"]["id"] for e in raw.events if e["type"] in ("session.created", "session.updated")
        )
        log = await engine_log(cascade_server, sid)
    finally:
        await session.aclose()
        await model.aclose()
    raw.validate()
    story = _interrupted(session)[0]
    done = next(e for e in raw.of("response.done") if e["response"]["status"] == "cancelled")
    rid = done["response"]["id"]
    sent = " ".join(
        e["delta"] for e in raw.of("response.output_audio_transcript.delta") if e["response_id"] == rid
    )
    full = done["response"]["output"][0]["content"][0]["transcript"]
    assert words(story.text_content or "") and set(words(story.text_content or "")) <= set(words(sent)), (
        story.text_content,
        sent,
    )
    cut = [e for e in log if e.role == "assistant" and e.interrupted]
    assert cut, [(e.role, e.text) for e in log]
    assert set(words(cut[0].text)) <= set(words(sent)), (cut[0].text, sent)
    assert len(words(full)) <= len(words(sent)) + 1


def _interrupted(session: AgentSession) -> list[Any]:
    return [
        item
        for item in session.history.items
        if item.type == "message" and item.role == "assistant" and getattr(item, "interrupted", False)
    ]


async def test_out_of_band_response_max_output_tokens_and_idle_timeout(cascade_server: ServerProcess) -> None:
    """``conversation: "none"`` answers without joining the conversation (the engine forgets it);
    ``max_output_tokens`` cuts an answer (``incomplete``); ``idle_timeout_ms`` makes the model go on after the
    caller stays silent."""
    session = {"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1500}}}}
    async with sdk_caller(cascade_server, session) as c:
        sid = c.log.events[0]["session"]["id"]
        await c.conn.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": QUESTION}],
                },
            }
        )
        await c.conn.send(
            {"type": "response.create", "response": {"conversation": "none", "metadata": {"kind": "oob"}}}
        )
        oob = await c.logged(lambda e: e["type"] == "response.done", 60)
        assert (
            oob["response"]["metadata"] == {"kind": "oob"} and oob["response"].get("conversation_id") is None
        )
        oob_item = oob["response"]["output"][0]
        assert "paris" in oob_item["content"][0]["transcript"].lower(), oob
        assert oob_item["id"] not in {e["item"]["id"] for e in c.log.of("conversation.item.added")}
        await engine_log_when(
            cascade_server,
            sid,
            lambda log: not any(e.role == "assistant" and "paris" in e.text.lower() for e in log),
        )
        await c.conn.send(
            {
                "type": "response.create",
                "response": {"instructions": "Tell a long story about a dragon.", "max_output_tokens": 3},
            }
        )
        capped = await c.logged(
            lambda e: e["type"] == "response.done" and e["response"]["id"] != oob["response"]["id"], 60
        )
        assert capped["response"]["status"] == "incomplete", capped
        assert capped["response"]["status_details"]["reason"] == "max_output_tokens"
        # Counted in the thinker's tokens: the engine stopped generating at the third.
        assert capped["response"]["usage"]["output_tokens"] == 3, capped["response"]["usage"]
        assert len(words(capped["response"]["output"][0]["content"][0]["transcript"])) <= 3
        # Its one-time instructions left the engine's conversation with it.
        await engine_log_when(
            cascade_server,
            sid,
            lambda log: not any("dragon" in e.text.lower() for e in log if e.role == "developer"),
        )
        timeout = await c.until("input_audio_buffer.timeout_triggered", 20)
        assert timeout["audio_end_ms"] >= timeout["audio_start_ms"]
        follow = await c.until("response.created", 20)
        assert follow["response"]["status"] == "in_progress"
        await c.until("response.done", 60)


async def engine_stats(server: ServerProcess, session_id: str) -> p.SessionStats:
    client = await EngineClient.connect("unix:" + server.socket_path)
    try:
        return await client.session_stats(session_id)
    finally:
        await client.close()


async def test_settings_changed_mid_session_reach_the_engine(cascade_server: ServerProcess) -> None:
    """``session.update`` after the engine session opened is honoured by the engine: new instructions become its
    system prompt with the conversation kept, the voice (an installed espeak-ng voice by name) voices the next
    answer, and ``max_output_tokens`` stops it at that many thinker tokens (``incomplete``)."""
    async with sdk_caller(cascade_server, {}, mic=False) as c:
        sid = c.log.events[0]["session"]["id"]
        await c.conn.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": QUESTION}],
                },
            }
        )
        await c.conn.send({"type": "response.create"})
        first = await c.logged(lambda e: e["type"] == "response.done", 60)
        assert first["response"]["status"] == "completed", first
        stats = await engine_stats(cascade_server, sid)
        assert stats.extra["turn_records"][-1]["voice"] == "piper"
        new = "You are a pirate. Answer in one short sentence."
        await c.conn.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "instructions": new,
                    "max_output_tokens": 3,
                    "audio": {"output": {"voice": "en-us"}},
                },
            }
        )
        updated = await c.until("session.updated", 10)
        assert updated["session"]["max_output_tokens"] == 3
        await c.conn.send({"type": "response.create"})
        capped = await c.logged(
            lambda e: e["type"] == "response.done" and e["response"]["id"] != first["response"]["id"], 60
        )
        stats = await engine_stats(cascade_server, sid)  # while the session is open
    resp = capped["response"]
    assert resp["status"] == "incomplete" and resp["status_details"]["reason"] == "max_output_tokens", resp
    assert resp["usage"]["output_tokens"] == 3, resp["usage"]
    assert len(c.audio.get(resp["id"], b"")) > 0
    assert stats.log[0].role == "system" and stats.log[0].text == new, stats.log[0]
    assert [e.text for e in stats.log if e.role == "user"] == [QUESTION]
    assert stats.extra["instructions_rebuilds"] == 1
    record = stats.extra["turn_records"][-1]
    assert record["voice"] == "espeak:en-us" and record["capped"] is True and record["output_tokens"] == 3
