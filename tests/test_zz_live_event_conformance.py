"""Every frame the Live facade sent during this test session, validated against the openai SDK's models.

Each ``livekit-omni serve`` started by the tests appends every frame it sends, exactly as sent (audio deltas with
their payload), to the JSONL log named by ``LIVEKIT_OMNI_EVENT_LOG`` (tests/conftest.py sets it). This module runs
last (``zz``) and checks every logged frame: a JSON object whose ``type`` is a server event of the SDK's
``ServerEvent`` union, valid against that event's pydantic model in strict mode (wrong field types and missing
required fields fail), decodable by the server's own types (livekit_omni.live.wire), plus the protocol rules the
models cannot express (unique event ids, transcript timing, audio that is base64 of whole samples). An empty log
fails every test: it means the Live tests did not run or the log did not record them, and nothing was checked.
"""

from __future__ import annotations

import base64
import binascii
import json
import typing
from collections import Counter
from typing import Any

import pytest
from openai.types.live import ServerEvent
from pydantic import BaseModel, ValidationError

from livekit_omni.live import wire
from tests.conftest import EVENT_LOGS

EVENT_LOG = EVENT_LOGS["live"]


def _models_by_type() -> dict[str, type[BaseModel]]:
    union = typing.get_args(ServerEvent)[0]  # Annotated[Union[...], PropertyInfo(discriminator="type")]
    out: dict[str, type[BaseModel]] = {}
    for model in typing.get_args(union):
        (literal,) = typing.get_args(model.model_fields["type"].annotation)
        out[literal] = model
    return out


MODELS = _models_by_type()


def _read_log() -> list[tuple[bytes, dict[str, Any]]]:
    if not EVENT_LOG.is_file():
        return []
    out = []
    for n, line in enumerate(EVENT_LOG.read_bytes().splitlines(), 1):
        if line.strip():
            ev = json.loads(line)
            assert isinstance(ev, dict) and isinstance(ev.get("type"), str), f"line {n}: {line[:200]!r}"
            out.append((line, ev))
    return out


@pytest.fixture(scope="module")
def frames() -> list[tuple[bytes, dict[str, Any]]]:
    """(raw frame, parsed object) per logged frame; fails the test when nothing was logged."""
    logged = _read_log()
    assert logged, f"no server events were logged to {EVENT_LOG}; did the Live tests run?"
    return logged


@pytest.fixture(scope="module")
def events(frames: list[tuple[bytes, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [ev for _, ev in frames]


def test_the_log_holds_events_and_audio(events: list[dict[str, Any]]) -> None:
    types = Counter(ev["type"] for ev in events)
    assert types["session.started"] and types["session.closed"], types
    assert types["session.output_audio.delta"], (
        "no audio delta was logged: the log misses what crossed the wire"
    )


def test_every_event_validates_against_the_sdk_model(events: list[dict[str, Any]]) -> None:
    failures: list[str] = []
    for ev in events:
        model = MODELS.get(ev["type"])
        if model is None:
            failures.append(f"unknown server event type {ev['type']!r}")
            continue
        try:
            model.model_validate(ev, strict=True)
        except ValidationError as e:
            failures.append(f"{ev['type']}: {e.errors()[:3]} in {json.dumps(ev)[:300]}")
    assert not failures, f"{len(failures)} invalid events, e.g.:\n" + "\n".join(failures[:10])


def test_every_frame_decodes_with_the_servers_own_types(frames: list[tuple[bytes, dict[str, Any]]]) -> None:
    failures = []
    for raw, _ in frames:
        try:
            wire.decode_server_event(raw)
        except (wire.UnknownServerEvent, ValueError) as e:
            failures.append(f"{e}: {raw[:200]!r}")
    assert not failures, f"{len(failures)} frames do not decode, e.g.:\n" + "\n".join(failures[:10])


def test_audio_deltas_are_base64_of_whole_samples(events: list[dict[str, Any]]) -> None:
    deltas = [ev for ev in events if ev["type"] == "session.output_audio.delta"]
    assert deltas
    for ev in deltas:
        assert set(ev) == {"type", "delta"}, ev.keys()  # no event_id, no timestamps on the primary WebSocket
        try:
            raw = base64.b64decode(ev["delta"], validate=True)
        except (binascii.Error, ValueError):
            pytest.fail(f"audio delta is not base64: {ev['delta'][:80]!r}")
        # Non-empty; PCM16 sessions send whole 16-bit samples, G.711 ones one byte a sample (any count is whole).
        assert raw, ev


def test_event_ids_are_unique(events: list[dict[str, Any]]) -> None:
    ids = Counter(ev["event_id"] for ev in events if "event_id" in ev)
    dupes = [i for i, n in ids.items() if n > 1]
    assert not dupes, dupes[:10]
    for ev in events:
        # Only audio deltas may go without an id (their SDK model has none).
        if ev["type"] != "session.output_audio.delta":
            assert isinstance(ev.get("event_id"), str) and ev["event_id"], ev


@pytest.mark.parametrize("kind", ["input", "output"])
def test_transcript_deltas_follow_the_timeline_rules(events: list[dict[str, Any]], kind: str) -> None:
    # openai.lib.live.TranscriptGrouper's rules: integer ms (bools rejected), non-negative, end >= start.
    for ev in events:
        if ev["type"] == f"session.{kind}_transcript.delta":
            s, e = ev["start_ms"], ev["end_ms"]
            assert type(s) is int and type(e) is int and 0 <= s <= e, ev
            assert isinstance(ev["delta"], str)


def test_session_closed_is_terminal_and_carries_usage(events: list[dict[str, Any]]) -> None:
    for ev in events:
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
