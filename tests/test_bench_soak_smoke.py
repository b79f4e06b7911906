"""Smoke test for benchmarks/soak.py: a ``--quick`` soak (two spoken conversations for 30 s in 10 s windows)
against a real server with the embedded models completes and ends with the JSON the issue asks for.

The targets (RSS within ±10 %, p95 within 1.2x, nothing dropped, no restart) are what the benchmark measures over
30 minutes, so they are not asserted on half a minute; what is asserted is that every window was recorded with real
figures: conversations answered, both processes' RSS read, the counters read from /metrics and /health.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "soak.py"


def test_soak_quick_records_every_window_and_reports_json(tmp_path: Path) -> None:
    capacity = tmp_path / "capacity.json"
    capacity.write_text(json.dumps({"sessions_realtime": 2}))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--capacity-result", str(capacity)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,  # ~60 s: server start-up, 30 s of calls, the turns under way at the end
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "window 1/3" in proc.stderr, "progress lines as it runs"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("rss_drift_pct", "p95_last_over_first", "dropped_events", "ring_overruns", "engine_restarts"):
        assert key in out, key
    assert out["sessions"] == 2 and out["minutes"] == 0.5 and out["window_s"] == 10.0
    windows = out["windows"]
    assert [w["window"] for w in windows] == [1, 2, 3]
    assert out["turns"] >= 4 and out["turns"] == sum(w["turns"] for w in windows), out
    for w in windows:
        assert 50 < w["server_rss_mb"] < 4096 and 200 < w["engine_rss_mb"] < 16384, w
    assert all(isinstance(out[k], int | float) for k in ("rss_drift_pct", "dropped_events", "ring_overruns"))
    assert -50 < out["rss_drift_pct"] < 50
    assert out["engine_restarts"] == 0 and out["sessions_lost"] == 0, out
    assert out["p95_last_over_first"] is None or out["p95_last_over_first"] > 0
