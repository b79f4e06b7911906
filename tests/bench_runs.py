"""Running a benchmark script the way a user does, for the benchmarks' smoke tests: ``python benchmarks/NAME.py
ARGS`` from the repository root, which must exit 0 and print its tables, then one JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(name: str, *args: str, timeout: float) -> tuple[dict[str, Any], str]:
    """``benchmarks/{name}.py ARGS``: its last-line JSON and its whole stdout (a failed run fails the test with the
    end of its stderr; a run that printed only the JSON line fails too: the tables are missing)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 1, "expected the tables before the JSON line"
    out: dict[str, Any] = json.loads(lines[-1])
    return out, proc.stdout
