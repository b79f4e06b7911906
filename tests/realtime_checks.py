"""Checks shared by the Realtime tests: every server event against the openai SDK's own types, strictly.

:class:`ServerEventLog` keeps every event a test received; :meth:`ServerEventLog.validate` checks each one against
the SDK's ``RealtimeServerEvent`` union in pydantic's strict mode, and fails on an empty log (a test that received
nothing has checked nothing).
"""

from __future__ import annotations

import json
import typing
from typing import Any

from openai.types.realtime import RealtimeServerEvent
from pydantic import BaseModel, TypeAdapter, ValidationError

_adapter: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
#: Each member of the union by its ``type`` literal, to name the member an event fails (the union's own error
#: lists all 46).
_MEMBERS: dict[str, type[BaseModel]] = {
    typing.get_args(m.model_fields["type"].annotation)[0]: m
    for m in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}


def validate_event(ev: dict[str, Any]) -> None:
    """Raise AssertionError if ``ev`` is not a valid Realtime server event (strict: no coercion)."""
    member = _MEMBERS.get(str(ev.get("type")))
    assert member is not None, f"{ev.get('type')!r} is not a type of the RealtimeServerEvent union"
    try:
        member.model_validate(ev, strict=True)
        model = _adapter.validate_python(ev, strict=True)
    except ValidationError as e:
        raise AssertionError(f"{ev['type']!r} does not validate against the SDK's types: {e}\n{ev}") from None
    assert model.type == ev["type"], (model.type, ev["type"])
    assert isinstance(ev.get("event_id"), str) and ev["event_id"], ev


class ServerEventLog:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def add(self, raw: str | bytes | dict[str, Any]) -> dict[str, Any]:
        ev = raw if isinstance(raw, dict) else json.loads(raw)
        self.events.append(ev)
        return ev

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def of(self, etype: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == etype]

    def validate(self) -> int:
        """Validate every event; returns how many. An empty log fails."""
        assert self.events, "no server events were received, so none were validated"
        for ev in self.events:
            validate_event(ev)
        return len(self.events)
