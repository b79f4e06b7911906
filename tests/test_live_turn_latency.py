"""livekit_omni.live.turn_latency: which reply answers a caller's turn, whatever order its audio and the engine's
end-of-turn event reach the server in."""

from __future__ import annotations

import pytest

from livekit_omni.live.turn_latency import TurnLatencyClock


def test_the_first_reply_to_begin_after_the_stop_is_timed_from_the_stop() -> None:
    clock = TurnLatencyClock()
    clock.caller_started()
    assert clock.caller_stopped(10.0) is None
    assert clock.reply_frame(1, 10.7) == pytest.approx(0.7)
    assert clock.reply_frame(1, 10.72) is None  # later frames of the answer are not turns
    assert clock.reply_frame(2, 12.0) is None  # a reply nobody asked for since is not timed


def test_an_answer_whose_audio_beat_the_stop_event_counts_as_zero_not_as_missing() -> None:
    """The reply's audio comes through the ring, the decision through the control socket: a reply ready at the
    decision can go out first. It is still this turn's answer (the CI flake this fixes: no turn measured)."""
    clock = TurnLatencyClock()
    clock.caller_started()
    assert clock.reply_frame(1, 10.0) is None
    assert clock.caller_stopped(10.01) == 0.0
    assert clock.reply_frame(1, 10.02) is None
    clock.caller_started()  # the next turn is paired on its own
    assert clock.caller_stopped(20.0) is None
    assert clock.reply_frame(2, 20.5) == pytest.approx(0.5)


def test_a_reply_playing_when_the_caller_spoke_is_not_the_answer() -> None:
    clock = TurnLatencyClock()
    assert clock.reply_frame(1, 1.0) is None  # the model is talking
    clock.caller_started()  # the caller talks over it (a barge-in or a backchannel)
    assert clock.reply_frame(1, 1.5) is None
    assert clock.caller_stopped(2.0) is None
    assert clock.reply_frame(1, 2.1) is None  # still the old reply
    assert clock.reply_frame(2, 2.9) == pytest.approx(0.9)


def test_an_engine_that_reports_only_the_stop_is_timed_from_the_stop() -> None:
    clock = TurnLatencyClock()
    assert clock.reply_frame(1, 0.5) is None
    assert clock.caller_stopped(3.0) is None
    assert clock.reply_frame(1, 3.1) is None
    assert clock.reply_frame(2, 3.8) == pytest.approx(0.8)
