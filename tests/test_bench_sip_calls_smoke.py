"""Smoke test for benchmarks/sip_calls.py: a small loopback run (steps of 4 and 8 calls, no models) completes and
ends with the JSON line the issue asks for.

The capacity target (50 calls at real time on the loopback engine) is what the benchmark measures about the machine,
not asserted here; what is asserted is that the harness really ran: every call was set up through SIP, its RTP
came back at real time, and the server's CPU was read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "sip_calls.py"


def test_sip_calls_loopback_steps_run_and_report_json() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-models", "--steps", "4,8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["benchmark"] == "sip_calls"
    assert out["sip_calls_realtime_loopback"] == 8, out
    for row in out["loopback_steps"]:
        assert row["held"] and row["refused"] == 0 and row["min_share"] >= 0.97, row
        assert 0 < row["server_cpu_per_call_pct"] < 50, row
