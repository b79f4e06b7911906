"""Every server event the Live facade emitted during this test session, validated against the openai SDK's models.

Each ``livekit-omni serve`` started by the tests appends its events to the JSONL log named by
``LIVEKIT_OMNI_EVENT_LOG`` (tests/conftest.py sets it; audio deltas are logged with the payload elided). This module
runs last (``zz``) and checks every logged event: a JSON object whose ``type`` is a server event of the SDK's
``ServerEvent`` union, valid against that event's pydantic model in strict mode (wrong field types and missing
required fields fail), plus the protocol rules the models cannot express (unique event ids, transcript timing).
"""

from __future__ import annotations

import json
import typing
from collections import Counter
from typing import Any

import pytest
from openai.types.live import ServerEvent
from pydantic import BaseModel, ValidationError

from tests.conftest import EVENT_LOG


def _models_by_type() -> dict[str, type[BaseModel]]:
    union = typing.get_args(ServerEvent)[0]  # Annotated[Union[...], PropertyInfo(discriminator="type")]
    out: dict[str, type[BaseModel]] = {}
    for model in typing.get_args(union):
        (literal,) = typing.get_args(model.model_fields["type"].annotation)
        out[literal] = model
    return out


MODELS = _models_by_type()


def _events() -> list[dict[str, Any]]:
    if not EVENT_LOG.is_file():
        return []
    out = []
    for n, line in enumerate(EVENT_LOG.read_text().splitlines(), 1):
        if line.strip():
            ev = json.loads(line)
            assert isinstance(ev, dict) and isinstance(ev.get("type"), str), f"line {n}: {line[:200]}"
            out.append(ev)
    return out


def test_the_servers_logged_events() -> None:
    events = _events()
    assert events, f"no server events were logged to {EVENT_LOG}; did the Live tests run?"


def test_every_event_validates_against_the_sdk_model() -> None:
    failures: list[str] = []
    for ev in _events():
        model = MODELS.get(ev["type"])
        if model is None:
            failures.append(f"unknown server event type {ev['type']!r}")
            continue
        try:
            model.model_validate(ev, strict=True)
        except ValidationError as e:
            failures.append(f"{ev['type']}: {e.errors()[:3]} in {json.dumps(ev)[:300]}")
    assert not failures, f"{len(failures)} invalid events, e.g.:\n" + "\n".join(failures[:10])


def test_event_ids_are_unique() -> None:
    ids = Counter(ev["event_id"] for ev in _events() if "event_id" in ev)
    dupes = [i for i, n in ids.items() if n > 1]
    assert not dupes, dupes[:10]
    for ev in _events():
        # Only audio deltas may go without an id (their SDK model has none).
        if ev["type"] != "session.output_audio.delta":
            assert isinstance(ev.get("event_id"), str) and ev["event_id"], ev


@pytest.mark.parametrize("kind", ["input", "output"])
def test_transcript_deltas_follow_the_timeline_rules(kind: str) -> None:
    # openai.lib.live.TranscriptGrouper's rules: integer ms (bools rejected), non-negative, end >= start.
    for ev in _events():
        if ev["type"] == f"session.{kind}_transcript.delta":
            s, e = ev["start_ms"], ev["end_ms"]
            assert type(s) is int and type(e) is int and 0 <= s <= e, ev
            assert isinstance(ev["delta"], str)


def test_session_closed_is_terminal_and_carries_usage() -> None:
    for ev in _events():
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
