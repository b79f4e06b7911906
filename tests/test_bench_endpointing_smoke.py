"""Smoke test for benchmarks/endpointing.py: a --quick run at no pause and at the control pause (longer than the
endpoint silence) counts the control's cut-offs and none at no pause, so the count can tell a split turn from a
whole one. The 300 ms figure itself is the benchmark's to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "endpointing.py"

pytestmark = pytest.mark.models


def test_endpointing_quick_sees_the_control_cut_and_the_baseline_whole() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--pauses", "0", "900"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # ~1 min on a quiet machine
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected a table before the JSON line"
    out = json.loads(lines[-1])
    assert "false_cutoff_rate_300ms" in out and out["questions"] == 3
    assert out["pauses"]["0"] == {"utterances": 3, "cut_off": 0, "rate": 0.0}, out
    assert out["pauses"]["900"]["cut_off"] == 3, out
