"""benchmarks/_callers.py's HeardAudio: when the caller hears the first audible sample of an answer, given the
chunks it received and their arrival times (what every spoken benchmark's voice-to-voice stops at)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _callers import HeardAudio

RATE = 24_000
MS = RATE // 1000


def tone(ms: int, amplitude: float = 4000.0) -> np.ndarray:
    t = np.arange(ms * MS) / RATE
    return (amplitude * np.sin(2 * np.pi * 300 * t)).astype(np.int16)


def test_first_audible_window_is_heard_at_its_chunk_arrival_plus_its_offset() -> None:
    heard = HeardAudio(RATE)
    quiet = np.zeros(40 * MS, np.int16)
    heard.add(10.0, quiet)
    heard.add(10.04, quiet)
    # Third chunk (arrives at 10.08): 20 ms quiet, then speech. Its first loud window starts 20 ms into it.
    heard.add(10.08, np.concatenate([np.zeros(20 * MS, np.int16), tone(20)]))
    heard.scan()
    assert heard.windows_received() == 12
    (w, at), *rest = heard.loud
    assert w == 10 and at == pytest.approx(10.08 + 0.020)
    assert [x for x, _ in rest] == [11]
    # Scans are incremental: a later chunk adds its own windows only.
    heard.add(10.12, tone(40))
    heard.scan()
    assert [x for x, _ in heard.loud] == [10, 11, 12, 13, 14, 15]
    assert heard.loud[-1][1] == pytest.approx(10.12 + 0.030)


def test_below_the_floor_is_not_heard_and_the_search_respects_time_and_window() -> None:
    heard = HeardAudio(RATE)
    heard.add(1.0, tone(30, amplitude=150))  # about -50 dBFS RMS: under -45
    heard.add(1.03, tone(30))  # audible
    heard.add(1.06, np.zeros(30 * MS, np.int16))
    heard.add(1.09, tone(30))  # audible again
    heard.scan()
    assert [w for w, _ in heard.loud] == [3, 4, 5, 9, 10, 11]
    assert heard.first_loud_after(0.0) == (3, pytest.approx(1.03))
    assert heard.first_loud_after(1.045)[0] == 5  # window 4 was heard at 1.04
    assert heard.first_loud_after(0.0, from_window=6) == (9, pytest.approx(1.09))
    assert heard.first_loud_after(2.0) is None


def test_windows_that_straddle_chunks_count_in_the_first() -> None:
    heard = HeardAudio(RATE)
    heard.add(5.0, np.zeros(15 * MS, np.int16))
    heard.add(5.015, tone(15))  # window 1 spans 10-20 ms: half quiet, half loud (RMS still above -45 dBFS)
    heard.scan()
    assert heard.loud[0] == (1, pytest.approx(5.010))
    with pytest.raises(ValueError):
        HeardAudio(22_050)
