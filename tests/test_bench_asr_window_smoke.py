"""Smoke test for benchmarks/asr_window.py: a --quick run completes and reports both windows' figures.

Which window is faster is not asserted (the benchmark is the place to read it; this box is shared), only that each
figure is there, the fitted window is the one the transcriptions used, and the error counts add up.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "asr_window.py"

pytestmark = pytest.mark.models


def test_asr_window_quick_reports_both_windows() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # ~15 s on a quiet machine; the slack is for a loaded one, not a budget
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected a table before the JSON line"
    out = json.loads(lines[-1])
    for key in ("asr_final_ms_full", "asr_final_ms_fit", "cpu_s_full", "cpu_s_fit", "tail_full_window_ms"):
        assert isinstance(out[key], float) and math.isfinite(out[key]) and out[key] > 0, (key, out[key])
    assert out["utterances"] == len(out["rows"]) == 4
    for w in ("full", "fit"):
        assert out[f"word_errors_{w}"] == sum(r[f"errors_{w}"] for r in out["rows"])
        assert math.isclose(out[f"wer_{w}"], round(out[f"word_errors_{w}"] / out["words"], 2), abs_tol=0.01)
    for r in out["rows"]:
        assert r["window_ms_full"] == 30_000
        # The fitted window covers what whisper is handed (the speech, its onset lead and its tail) plus 3 s.
        assert r["focused_ms"] + 3_000 <= r["window_ms_fit"] < 30_000
        assert r["heard_fit"] and r["heard_full"]
