"""What the session core needs of a dialect's wire module, as data: one :class:`WireCodec` per dialect.

Each dialect's wire module (``livekit_omni/live/wire.py``, ``livekit_omni/realtime/wire.py``) declares its commands and
events and builds its codec from its own functions; the session core decodes, encodes and reports errors through it,
so no session class repeats the wiring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

Command = TypeVar("Command")
Event = TypeVar("Event")
Event_co = TypeVar("Event_co", covariant=True)


class MakeError(Protocol[Event_co]):
    """``error_event(code, message, *, type, param, client_event_id)`` of a wire module."""

    def __call__(
        self,
        code: str,
        message: str,
        *,
        type: str = ...,
        param: str | None = None,
        client_event_id: str | None = None,
    ) -> Event_co: ...


@dataclass(frozen=True, slots=True)
class WireCodec(Generic[Command, Event]):
    #: One client message -> its command; raises ``WireError`` naming what is wrong.
    decode: Callable[[str | bytes], Command]
    #: One server event -> the JSON text of its frame.
    encode: Callable[[Event], bytes]
    #: The ``type`` of an event or command.
    event_type: Callable[[Event | Command], str]
    #: The dialect's ``error`` event.
    error_event: MakeError[Event]
    #: The class of the dialect's ``error`` event (its ``error.code`` is counted in the errors metric).
    error_class: type[Any]

    def error_code(self, ev: Event) -> str | None:
        """``error.code`` when ``ev`` is an ``error`` event, else None."""
        return ev.error.code if isinstance(ev, self.error_class) else None

    @staticmethod
    def client_event_id(cmd: Command) -> str | None:
        """The ``event_id`` a command carries (echoed as ``client_event_id``): both dialects name it so."""
        event_id = getattr(cmd, "event_id", None)
        return event_id if isinstance(event_id, str) else None
