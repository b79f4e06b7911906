"""Every frame each dialect sent during this test session, validated against the openai SDK's types.

Each ``livekit-omni serve`` started by the tests appends every frame it sends, exactly as sent (audio deltas with
their payload), to its dialect's JSONL log (``LIVEKIT_OMNI_EVENT_LOG``, which tests/conftest.py sets;
livekit_omni/sessions/eventlog.py). This module sorts last (``zz``), so in a full run it checks the whole suite's
frames. Where a dialect's log lacks what the checks need (a session opened and closed, an audio delta), which is
what happens when the module runs alone, with a ``-k`` selection or before the other tests, it first runs traffic of
its own against a cascade server it starts (real speech, a spoken answer), so the check never depends on which
tests ran before it. A log that still holds nothing after that fails: nothing was checked.

Live frames: a JSON object whose ``type`` is a member of the SDK's ``openai.types.live.ServerEvent`` union, valid
against that member's pydantic model in strict mode (wrong field types and missing required fields fail),
decodable by the server's own types (livekit_omni.live.wire), plus the protocol rules the models cannot express
(unique event ids, transcript timing, audio that is base64 of whole samples). The Responses events that
``response.event`` nests (delegation: tests/test_live_tools.py sends them) are checked against the SDK's
``ResponseStreamEvent`` union, strictly, and each belongs to a delegation announced before it.

Realtime frames: the same against ``openai.types.realtime.RealtimeServerEvent`` (the member by its ``type``, and the
discriminated union itself, both strict: tests/realtime_checks.py), decodable by the server's own server-event
structs (livekit_omni.realtime.wire.ServerEvent), unique event ids, and audio deltas that are base64 of whole
PCM16 samples.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.live import ServerEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter, ValidationError

from livekit_omni.live import wire as live_wire
from livekit_omni.realtime import wire as realtime_wire
from tests.conftest import EVENT_LOGS, ServerProcess, start_server
from tests.realtime_checks import validate_event
from tests.speech_fixtures import synthesize_speech

# Its own traffic runs on the cascade adapter (turns, transcripts and spoken answers need the models).
pytestmark = pytest.mark.models

Frames = list[tuple[bytes, dict[str, Any]]]

API_KEY = "sk-conformance"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
RATE = 24_000
CHUNK = RATE // 10  # 100 ms of PCM16 per append, at real time (the server drops a burst beyond its budget)


def _live_models_by_type() -> dict[str, type[BaseModel]]:
    union = typing.get_args(ServerEvent)[0]  # Annotated[Union[...], PropertyInfo(discriminator="type")]
    out: dict[str, type[BaseModel]] = {}
    for model in typing.get_args(union):
        (literal,) = typing.get_args(model.model_fields["type"].annotation)
        out[literal] = model
    return out


LIVE_MODELS = _live_models_by_type()
#: What a Live ``response.event`` nests: a member of the SDK's Responses streaming-event union.
RESPONSES_STREAM: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
_realtime_decoder = msgspec.json.Decoder(realtime_wire.ServerEvent)


def read_log(path: Path) -> Frames:
    """(raw frame, parsed object) per logged line."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            ev = json.loads(line)
            assert isinstance(ev, dict) and isinstance(ev.get("type"), str), f"line {n}: {line[:200]!r}"
            out.append((line, ev))
    return out


#: Per dialect, the event types a log must hold for every check of this module to have something to check.
NEEDED: dict[str, tuple[str, ...]] = {
    "live": ("session.started", "session.output_audio.delta", "session.closed", "response.event"),
    "realtime": ("session.created", "response.output_audio.delta", "response.done"),
}


def missing_types(dialect: str, frames: Frames) -> set[str]:
    return set(NEEDED[dialect]) - {ev["type"] for _, ev in frames}


# --- traffic of our own ------------------------------------------------------------------------------------------


def speech_then_silence(seconds_after: float) -> np.ndarray:
    speech = synthesize_speech(QUESTION, rate=RATE)
    return np.concatenate([speech, np.zeros(int(RATE * seconds_after), np.int16)])


def b64_chunks(pcm: np.ndarray) -> Iterator[str]:
    for pos in range(0, len(pcm), CHUNK):
        chunk = pcm[pos : pos + CHUNK]
        if len(chunk) < CHUNK:
            chunk = np.concatenate([chunk, np.zeros(CHUNK - len(chunk), np.int16)])
        yield base64.b64encode(chunk.astype("<i2").tobytes()).decode()


async def at_real_time(chunks: Iterator[str], send: Callable[[str], Any]) -> None:
    t0 = time.monotonic()
    for i, audio in enumerate(chunks):
        await send(audio)
        await asyncio.sleep(max(0.0, t0 + (i + 1) * 0.1 - time.monotonic()))


#: A responses delegation with one function tool under ``required``: the reply is a call, which the backend's stream
#: carries in ``response.event`` envelopes.
TOOL_DELEGATION: dict[str, Any] = {
    "type": "responses",
    "responses": {
        "model": "gpt-5.6-luna",
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            }
        ],
        "tool_choice": "required",
    },
}


async def live_traffic(server: ServerProcess, delegation: dict[str, Any] | None = None) -> None:
    """session.start, the question as audio at real time, the answer, session.close. Without ``delegation`` the
    answer is spoken and over once no words came for 3 s; with it, over at the nested ``response.completed``."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    session: dict[str, Any] = {
        "model": "gpt-live-1",
        "instructions": INSTRUCTIONS,
        "audio": {"format": {"type": "audio/pcm", "rate": RATE}},
    }
    if delegation is not None:
        session["delegation"] = delegation
    async with client.live.connect() as conn:
        await conn.session.start(session=session)
        types: list[str] = []

        async def until(pred: Callable[[dict[str, Any]], bool], timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while True:
                ev = json.loads(
                    await asyncio.wait_for(conn.recv_bytes(), max(0.1, deadline - time.monotonic()))
                )
                types.append(ev["type"])
                if pred(ev):
                    return

        await until(lambda ev: ev["type"] == "session.started", 15)

        async def speak(audio: str) -> None:
            await conn.session.input_audio.append(audio=audio)

        mic = asyncio.create_task(at_real_time(b64_chunks(speech_then_silence(15.0)), speak))
        try:
            if delegation is not None:
                await until(
                    lambda ev: ev["type"] == "response.event" and ev["event"]["type"] == "response.completed",
                    60,
                )
            else:
                await until(lambda ev: ev["type"] == "session.output_transcript.delta", 60)
                # The answer is over when no words came for 3 s (the output audio never stops: silence is sent too).
                last_words = time.monotonic()
                deadline = last_words + 40

                def words_or_quiet(ev: dict[str, Any]) -> bool:
                    nonlocal last_words
                    now = time.monotonic()
                    if ev["type"] == "session.output_transcript.delta":
                        last_words = now
                    return now - last_words > 3 or now > deadline

                await until(words_or_quiet, 45)
        finally:
            mic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mic
        await conn.session.close()
        await until(lambda ev: ev["type"] == "session.closed", 15)
    needed = "response.event" if delegation is not None else "session.output_audio.delta"
    assert needed in types, Counter(types)


async def realtime_traffic(server: ServerProcess) -> None:
    """session.update (server VAD, input transcription), the question as audio at real time, the spoken answer the
    server VAD's turn starts, a response.create for a second answer, then the client hangs up."""
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    async with client.realtime.connect(model="gpt-realtime") as conn:
        types: list[str] = []

        async def until(etype: str, timeout: float) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while True:
                ev = json.loads(
                    await asyncio.wait_for(conn.recv_bytes(), max(0.1, deadline - time.monotonic()))
                )
                types.append(ev["type"])
                if ev["type"] == etype:
                    return dict(ev)

        await until("session.created", 15)
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": INSTRUCTIONS,
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": RATE},
                        "turn_detection": {"type": "server_vad"},
                        "transcription": {"model": "gpt-4o-mini-transcribe"},
                    },
                    "output": {"format": {"type": "audio/pcm", "rate": RATE}},
                },
            }
        )
        await until("session.updated", 15)

        async def speak(audio: str) -> None:
            await conn.input_audio_buffer.append(audio=audio)

        mic = asyncio.create_task(at_real_time(b64_chunks(speech_then_silence(3.0)), speak))
        try:
            await until("response.done", 60)
        finally:
            mic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mic
        await conn.response.create()
        await until("response.done", 60)
    assert "response.output_audio.delta" in types, Counter(types)


class OwnTraffic:
    """One cascade server for this module, started only if a dialect's log needs traffic of its own."""

    def __init__(self) -> None:
        self.server: ServerProcess | None = None

    def run(self, dialect: str) -> None:
        if self.server is None:
            self.server = start_server(
                adapter="cascade", env={"LIVEKIT_OMNI_API_KEYS": json.dumps([API_KEY])}
            )
        if dialect == "live":
            asyncio.run(live_traffic(self.server))
            asyncio.run(
                live_traffic(self.server, TOOL_DELEGATION)
            )  # response.event: a reply that calls a tool
        else:
            asyncio.run(realtime_traffic(self.server))

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def own_traffic() -> Iterator[OwnTraffic]:
    traffic = OwnTraffic()
    yield traffic
    traffic.stop()


def logged_frames(dialect: str, own_traffic: OwnTraffic) -> Frames:
    path = EVENT_LOGS[dialect]
    logged = read_log(path)
    if missing_types(dialect, logged):
        own_traffic.run(dialect)
        # The server writes its log on a thread of its own: wait until what our traffic produced is there.
        deadline = time.monotonic() + 10
        while missing_types(dialect, logged := read_log(path)) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert logged, f"no {dialect} server events were logged to {path}, even after traffic of our own"
    return logged


@pytest.fixture(scope="module")
def live_frames(own_traffic: OwnTraffic) -> Frames:
    return logged_frames("live", own_traffic)


@pytest.fixture(scope="module")
def realtime_frames(own_traffic: OwnTraffic) -> Frames:
    return logged_frames("realtime", own_traffic)


@pytest.fixture(scope="module")
def live_events(live_frames: Frames) -> list[dict[str, Any]]:
    return [ev for _, ev in live_frames]


@pytest.fixture(scope="module")
def realtime_events(realtime_frames: Frames) -> list[dict[str, Any]]:
    return [ev for _, ev in realtime_frames]


#: A delta's byte count must be a multiple of this. PCM16 samples are 2 bytes. The log does not say which format a
#: session used, and G.711 (a byte a sample) passes too: both dialects send whole 20 ms output frames per delta,
#: 160 bytes at 8 kHz.
WHOLE_SAMPLE_BYTES = 2


def _is_base64_of_whole_samples(delta: object, sample_bytes: int) -> str | None:
    """None if ``delta`` is base64 of a non-empty whole number of samples, else what is wrong."""
    if not isinstance(delta, str):
        return f"not a string: {delta!r:.80}"
    try:
        raw = base64.b64decode(delta, validate=True)
    except (binascii.Error, ValueError):
        return f"not base64: {delta[:80]!r}"
    if not raw:
        return "empty"
    if len(raw) % sample_bytes:
        return f"{len(raw)} bytes is not a whole number of {sample_bytes}-byte samples"
    return None


# --- the Live dialect ---------------------------------------------------------------------------------------------


def test_live_log_holds_events_and_audio(live_events: list[dict[str, Any]]) -> None:
    types = Counter(ev["type"] for ev in live_events)
    assert types["session.started"] and types["session.closed"], types
    assert types["session.output_audio.delta"], (
        "no audio delta was logged: the log misses what crossed the wire"
    )


def test_live_every_event_validates_against_the_sdk_model(live_events: list[dict[str, Any]]) -> None:
    failures: list[str] = []
    for ev in live_events:
        model = LIVE_MODELS.get(ev["type"])
        if model is None:
            failures.append(f"unknown server event type {ev['type']!r}")
            continue
        try:
            model.model_validate(ev, strict=True)
        except ValidationError as e:
            failures.append(f"{ev['type']}: {e.errors()[:3]} in {json.dumps(ev)[:300]}")
    assert not failures, f"{len(failures)} invalid events, e.g.:\n" + "\n".join(failures[:10])


def test_live_every_frame_decodes_with_the_servers_own_types(live_frames: Frames) -> None:
    failures = []
    for raw, _ in live_frames:
        try:
            live_wire.decode_server_event(raw)
        except (live_wire.UnknownServerEvent, ValueError) as e:
            failures.append(f"{e}: {raw[:200]!r}")
    assert not failures, f"{len(failures)} frames do not decode, e.g.:\n" + "\n".join(failures[:10])


def test_live_audio_deltas_are_base64_of_whole_samples(live_events: list[dict[str, Any]]) -> None:
    deltas = [ev for ev in live_events if ev["type"] == "session.output_audio.delta"]
    assert deltas
    for ev in deltas:
        assert set(ev) == {"type", "delta"}, ev.keys()  # no event_id, no timestamps on the primary WebSocket
        problem = _is_base64_of_whole_samples(ev["delta"], WHOLE_SAMPLE_BYTES)
        assert problem is None, problem


def test_live_event_ids_are_unique(live_events: list[dict[str, Any]]) -> None:
    ids = Counter(ev["event_id"] for ev in live_events if "event_id" in ev)
    dupes = [i for i, n in ids.items() if n > 1]
    assert not dupes, dupes[:10]
    for ev in live_events:
        # Only audio deltas may go without an id (their SDK model has none).
        if ev["type"] != "session.output_audio.delta":
            assert isinstance(ev.get("event_id"), str) and ev["event_id"], ev


@pytest.mark.parametrize("kind", ["input", "output"])
def test_live_transcript_deltas_follow_the_timeline_rules(
    live_events: list[dict[str, Any]], kind: str
) -> None:
    # openai.lib.live.TranscriptGrouper's rules: integer ms (bools rejected), non-negative, end >= start.
    for ev in live_events:
        if ev["type"] == f"session.{kind}_transcript.delta":
            s, e = ev["start_ms"], ev["end_ms"]
            assert type(s) is int and type(e) is int and 0 <= s <= e, ev
            assert isinstance(ev["delta"], str)


def test_live_session_closed_is_terminal_and_carries_usage(live_events: list[dict[str, Any]]) -> None:
    for ev in live_events:
        if ev["type"] == "session.closed":
            assert ev["reason"] in (
                "close_requested",
                "expired",
                "content",
                "remote_hangup",
                "connection_lost",
            )
            assert isinstance(ev["usage"]["seconds"], float)
            assert ev["session"]["status"] == "active"


def test_live_response_events_nest_valid_responses_stream_events(live_events: list[dict[str, Any]]) -> None:
    envelopes = [ev for ev in live_events if ev["type"] == "response.event"]
    assert envelopes, "no response.event in the Live log, even after traffic of our own"
    failures: list[str] = []
    announced: set[str] = set()
    for ev in live_events:
        if ev["type"] == "session.delegation.created":
            announced.add(ev["delegation"]["id"])
        if ev["type"] != "response.event":
            continue
        try:
            nested = RESPONSES_STREAM.validate_python(ev["event"], strict=True)
            assert nested.type == ev["event"]["type"]
        except (ValidationError, AssertionError) as e:
            failures.append(f"{ev['event'].get('type')}: {str(e)[:300]} in {json.dumps(ev)[:300]}")
        did = ev.get("delegation_id")
        if did is not None and did not in announced:
            failures.append(f"response.event of delegation {did!r} before its session.delegation.created")
    assert not failures, f"{len(failures)} invalid response.event frames, e.g.:\n" + "\n".join(failures[:10])


# --- the Realtime dialect -----------------------------------------------------------------------------------------


def test_realtime_log_holds_events_and_audio(realtime_events: list[dict[str, Any]]) -> None:
    types = Counter(ev["type"] for ev in realtime_events)
    assert types["session.created"] and types["response.done"], types
    assert types["response.output_audio.delta"], (
        "no audio delta was logged: the log misses what crossed the wire"
    )


def test_realtime_every_event_validates_against_the_sdk_union(realtime_events: list[dict[str, Any]]) -> None:
    failures: list[str] = []
    for ev in realtime_events:
        try:
            validate_event(ev)
        except AssertionError as e:
            failures.append(str(e)[:600])
    assert not failures, f"{len(failures)} invalid events, e.g.:\n" + "\n".join(failures[:10])


def test_realtime_every_frame_decodes_with_the_servers_own_types(realtime_frames: Frames) -> None:
    failures = []
    for raw, _ in realtime_frames:
        try:
            _realtime_decoder.decode(raw)
        except msgspec.DecodeError as e:  # ValidationError included
            failures.append(f"{e}: {raw[:200]!r}")
    assert not failures, f"{len(failures)} frames do not decode, e.g.:\n" + "\n".join(failures[:10])


def test_realtime_audio_deltas_are_base64_of_whole_samples(realtime_events: list[dict[str, Any]]) -> None:
    deltas = [ev for ev in realtime_events if ev["type"] == "response.output_audio.delta"]
    assert deltas
    problems = []
    for ev in deltas:
        problem = _is_base64_of_whole_samples(ev["delta"], WHOLE_SAMPLE_BYTES)
        if problem is not None:
            problems.append(f"{problem} in {json.dumps(ev)[:200]}")
    assert not problems, f"{len(problems)} bad audio deltas, e.g.:\n" + "\n".join(problems[:10])


def test_realtime_event_ids_are_unique(realtime_events: list[dict[str, Any]]) -> None:
    ids = Counter(ev.get("event_id") for ev in realtime_events)
    dupes = [i for i, n in ids.items() if n > 1]
    assert not dupes, dupes[:10]
    assert all(isinstance(ev.get("event_id"), str) and ev["event_id"] for ev in realtime_events)
