"""The errors every thinker backend raises on purpose (re-exported by :mod:`engine_bridge.thinker.base`)."""

from __future__ import annotations


class ThinkerError(Exception):
    """Base class of every error a thinker backend raises on purpose."""


class ThinkerCapacityError(ThinkerError):
    """``open`` was refused: the session limit or the KV budget is exhausted. Raised before any compute."""


class UnknownSessionError(ThinkerError, KeyError):
    """No open session has this id (never opened, or already closed)."""


class ThinkerStateError(ThinkerError):
    """The call does not fit the session's state (e.g. ``append`` while a reply is being generated)."""
