"""Smoke test for benchmarks/instructions_rebuild.py: a --quick run on the real SmolLM2 completes and ends with its
JSON line. The timings are the benchmark's to read (a shared 2-core box), not asserted; what is asserted is that
it measured what it says: both rebuilds gave a log of the same length, and the figures are positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The real SmolLM2-135M.
pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "instructions_rebuild.py"


def test_instructions_rebuild_quick_runs_and_reports_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # ~15 s on the shared 2-core box, most of it loading the model
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 3, "expected the table before the JSON line"
    out = json.loads(lines[-1])
    assert out["quick"] is True
    for key in ("rebuild_ms_p50", "reappend_ms_p50", "note_ms_p50"):
        assert out[key]["4"] > 0, (key, out)
    assert out["log_tokens"]["4"] > 100  # the system segment, the example turns and four messages
