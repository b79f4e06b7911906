"""Mailbox messages the cascade's other threads post to the scheduler thread (the session's owner).

The audio thread posts what the turn detector decided (:class:`VadStart`, :class:`Speculate`, :class:`Resumed`,
:class:`Endpoint`, :class:`BargeInHeard`, :class:`OverlapCheck`); the ASR, end-of-turn and TTS workers post their
results (:class:`AsrDone`, :class:`EotDone`, :class:`TtsDone`). The engine core's own messages (text appends, interrupts, mute) live in
:mod:`engine_bridge.session`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine_bridge.speech.asr import Transcript
from engine_bridge.speech.vad import SpeechStopped


@dataclass(frozen=True, slots=True)
class VadStart:
    """The caller started a turn."""

    start_ms: int
    at_ms: int


@dataclass(frozen=True, slots=True)
class Speculate:
    """``speculative_ms`` of silence inside the turn: transcribe its audio now, before the endpoint."""

    audio: npt.NDArray[np.int16]
    start_ms: int
    end_ms: int
    at_wall: float


@dataclass(frozen=True, slots=True)
class Resumed:
    """The caller spoke again after a speculation was posted: it no longer describes the turn."""

    at_ms: int


#: Where the caller stopped hearing the reply: the egress playout report (epoch, turn id, samples played) taken
#: when the duck lowered it, or None when it was not ducked.
HeardUntil = tuple[int, int, int] | None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """The caller's turn ended (``silence_ms`` of silence)."""

    ev: SpeechStopped
    at_wall: float
    #: True when the turn began over model speech and stayed a backchannel: under the barge-in minimum, or
    #: words the backchannel check found to be only "mm-hm"s. It must not cancel the reply.
    backchannel: bool
    #: True when the turn's backchannel check (an :class:`OverlapCheck`) had no answer yet when it ended: the
    #: scheduler holds the endpoint until it has.
    undecided: bool = False


@dataclass(frozen=True, slots=True)
class BargeInHeard:
    """The caller interrupted model speech (see ``turns.watch_audio``); the audio thread already bumped the
    epoch."""

    epoch: int
    at_ms: int
    at_wall: float
    heard: HeardUntil = None


@dataclass(frozen=True, slots=True)
class OverlapCheck:
    """Caller speech over model speech passed the barge-in minimum and paused while the reply is ducked: are its
    words only a backchannel ("mm-hm", "yeah")? The scheduler transcribes ``audio`` and decides (flush or restore
    the level)."""

    audio: npt.NDArray[np.int16]
    #: The turn's start (which turn it is) and the end of the speech checked.
    start_ms: int
    end_ms: int
    at_wall: float
    heard: HeardUntil = None


@dataclass(frozen=True, slots=True)
class AsrDone:
    job: int
    transcript: Transcript
    elapsed_ms: float


@dataclass(frozen=True, slots=True)
class EotDone:
    """The end-of-turn model read the transcript of ASR job ``job`` (a speculation at a pause)."""

    job: int
    #: Probability that the caller's sentence is finished.
    probability: float
    elapsed_ms: float


@dataclass(frozen=True, slots=True)
class TtsDone:
    """One clause of reply ``turn_id`` is voiced (or was skipped)."""

    turn_id: int
    epoch: int


CascadeMessage = (
    VadStart | Speculate | Resumed | Endpoint | BargeInHeard | OverlapCheck | AsrDone | EotDone | TtsDone
)
