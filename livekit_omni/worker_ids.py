"""Which worker of ``livekit-omni serve --workers N`` this process is, and the tag that ties state to it.

With several workers (docs/deployment.md, "Workers") each one holds its own sessions, resume tokens, call ids and
ephemeral keys, while a request about one of them may land on any worker. So every id and token a worker issues
carries its index: ``live_w1.<hex>``, ``sess_w0.<hex>``, a resume token ``w1.<token>``, an ephemeral key
``ek_w1.<token>``. :func:`owner_of` reads it back, and :mod:`livekit_omni.routing` sends the request to that
worker. The random parts (hex, URL-safe base64) never hold a ``.``, so the first ``.`` always ends the tag.

With one worker (the default) nothing is tagged and ids look exactly as they always have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_TAG: Final = re.compile(r"(?:^|_)w(\d{1,4})$")


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    index: int
    count: int
    #: Folder of the workers' private Unix sockets (``worker-<index>.sock``): how one worker reaches another.
    socket_dir: str

    def socket_path(self, index: int) -> str:
        return f"{self.socket_dir}/worker-{index}.sock"


_current: WorkerIdentity | None = None


def set_current(identity: WorkerIdentity | None) -> None:
    """Called once by a worker process at start-up (``livekit_omni.workers``), before any id is issued."""
    global _current
    _current = identity


def current() -> WorkerIdentity | None:
    """This process's identity when it is one of several workers; None for a single server."""
    return _current


def tagged(random_part: str) -> str:
    """``random_part`` with this worker's tag in front (``w<index>.``); unchanged for a single server."""
    ident = _current
    return random_part if ident is None else f"w{ident.index}.{random_part}"


def owner_of(value: str) -> int | None:
    """The index of the worker that issued ``value`` (an id, token or key made with :func:`tagged` behind its
    prefix), or None for an untagged value."""
    head, dot, _ = value.partition(".")
    if not dot:
        return None
    m = _TAG.search(head)
    return int(m.group(1)) if m else None


def foreign_owner(value: str | None) -> int | None:
    """The worker that owns ``value`` when that is another worker than this one; None when it is ours, untagged,
    or this server has only one worker."""
    ident = _current
    if ident is None or not value:
        return None
    owner = owner_of(value)
    if owner is None or owner == ident.index or not 0 <= owner < ident.count:
        return None
    return owner
