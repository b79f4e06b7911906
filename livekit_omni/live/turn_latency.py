"""The server's turn latency: the engine's end-of-turn decision → the first frame of the reply that answers it.

The decision reaches the server as a ``SpeechStopped`` event on the control socket; the reply's audio comes
through the egress ring, written by the engine's audio thread. The two paths are independent, so when the reply
is ready at the decision (a speculative reply, a loaded machine delaying the event) its first frame can be sent
before the event is read. Pairing "the first reply to begin after the event" would then skip the answer and never
measure the turn (or measure the next reply against this stop). So the pairing is by what the caller did, not by
arrival order:

* the answer is the first reply to *begin* playing after the caller started speaking (``SpeechStarted``) or, for
  an engine that does not report the start, after the stop;
* its latency is from the stop's arrival to its first frame, and 0 when its first frame went out before the stop
  arrived (it was on the wire the moment the decision was known).

A reply that was already playing when the caller spoke is never the answer (the caller talked over it; the
answer is the next one). One clock per session; nothing grows.
"""

from __future__ import annotations


class TurnLatencyClock:
    def __init__(self) -> None:
        self._playing_turn = 0  # the reply whose frames are going out (0: none yet)
        self._awaiting = False  # the caller spoke: the next reply to begin is the answer
        self._stopped_at: float | None = None  # the stop arrived at (monotonic), answer not yet begun
        self._began_early = False  # the answer began before the stop arrived

    def caller_started(self) -> None:
        self._awaiting, self._stopped_at, self._began_early = True, None, False

    def caller_stopped(self, now: float) -> float | None:
        """The end-of-turn decision arrived; returns the turn's latency when its answer has already begun."""
        if self._began_early:
            self._awaiting = self._began_early = False
            return 0.0
        self._awaiting, self._stopped_at = True, now
        return None

    def reply_frame(self, turn_id: int, now: float) -> float | None:
        """A frame of model audio of ``turn_id`` went out; returns the turn's latency when it is the answer's first."""
        if turn_id == self._playing_turn:
            return None
        self._playing_turn = turn_id
        if not self._awaiting:
            return None
        if self._stopped_at is None:
            self._began_early = True
            return None
        latency = now - self._stopped_at
        self._awaiting, self._stopped_at = False, None
        return latency
