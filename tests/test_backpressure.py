"""The input budget both facade dialects share (livekit_omni/sessions/backpressure.py): no server needed."""

from __future__ import annotations

import pytest

from livekit_omni.sessions.backpressure import InputBudget, InputVerdict


def test_real_time_input_is_always_admitted() -> None:
    b = InputBudget(burst_s=1.0, grace_s=1.0, now=0.0)
    assert all(b.admit(0.1, 0.1 * i) is InputVerdict.ADMIT for i in range(1, 200))


def test_a_burst_fits_then_excess_warns_once_then_closes_after_the_grace() -> None:
    b = InputBudget(burst_s=1.0, grace_s=1.0, now=0.0)
    assert b.admit(1.0, 0.0) is InputVerdict.ADMIT
    assert b.admit(0.5, 0.0) is InputVerdict.DROP_AND_WARN
    assert b.admit(0.6, 0.5) is InputVerdict.DROP  # 0.5 s drained: 0.5 + 0.6 is still over
    assert b.admit(2.0, 1.6) is InputVerdict.CLOSE


def test_an_episode_ends_once_drained_below_half() -> None:
    b = InputBudget(burst_s=1.0, grace_s=1.0, now=0.0)
    b.admit(1.0, 0.0)
    assert b.admit(0.5, 0.0) is InputVerdict.DROP_AND_WARN
    assert b.admit(0.1, 0.8) is InputVerdict.ADMIT  # 0.2 + 0.1 < half: the episode is over
    b.admit(0.7, 0.8)
    assert b.admit(0.5, 0.8) is InputVerdict.DROP_AND_WARN  # a new episode warns again


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        InputBudget(burst_s=0, grace_s=1, now=0)
