"""Smoke test for benchmarks/endpointing.py: a --quick run (2 questions) with no pause and a 1000 ms mid-sentence pause
reports every figure the issue names, in the same run as the silence-only endpoint, and no unpaused question is cut.
Whether a paused question is kept whole is the benchmark's figure (and tests/test_engine_cascade.py's test of one)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "endpointing.py"

pytestmark = pytest.mark.models


def test_endpointing_quick_reports_the_issue_figures_beside_the_silence_only_endpoint() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--pauses", "0", "1000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # ~1-2 min on a quiet machine
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected a table before the JSON line"
    out = json.loads(lines[-1])
    assert out["questions"] == 2
    for key in ("false_cutoff_rate_at_1000ms", "right_rate_unpaused", "right_rate_at_1000ms"):
        assert 0.0 <= out[key] <= 1.0, (key, out)
    for key in ("complete_turn_end_ms_p50", "complete_turn_end_ms_p50_silence_only", "eot_model_ms_p50"):
        assert isinstance(out[key], float) and math.isfinite(out[key]) and out[key] > 0, (key, out)
    assert out["false_cutoff_rate_at_0ms"] == 0.0, out
    assert out["pauses"]["model_0ms"]["utterances"] == out["pauses"]["silence_0ms"]["utterances"] == 2, out
    assert out["eot_model_calls"] > 0, out
