"""Smoke test for benchmarks/gpu_check.py on the CPU: ``--device cpu --quick`` runs both models through the real
torch thinker (batched steps over 1 and 2 sessions) and writes the JSON it prints.

The GPU figures themselves come from a run on a CUDA machine; here only the harness is checked: every requested
session count was measured with positive rates, the context is the 7-turn history plus turn 8, and the file
written to ``--out`` is the last stdout line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# The real SmolLM2-135M (and a 1B random Llama) through the torch thinker.
pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def test_gpu_check_quick_on_cpu_writes_its_json(tmp_path: Path) -> None:
    out_path = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--quick",
            "--sessions",
            "1,2",
            "--out",
            str(out_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # ~30-60 s on the shared 2-core box
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out_path.read_text()) == printed
    assert printed["device"] == "cpu" and printed["dtype"] == "float32" and printed["sessions"] == [1, 2]
    assert set(printed["models"]) == {"smollm2-135m", "random-llama-1b"}
    for name, model in printed["models"].items():
        assert "error" not in model, (name, model)
        assert model["params_m"] > 1 and model["kv_bytes_per_token"] > 0
        rows = model["rows"]
        assert [r["sessions"] for r in rows] == [1, 2], rows
        for r in rows:
            assert r["decode_tok_s"] > 0 and r["ttft_turn8_ms"] > 0 and r["step_ms"] > 0, r
            assert r["context_tokens"] > 200, r  # 7 turns of history are resident before turn 8
        assert set(printed["summary"][name]) == {"1", "2"}
    assert printed["models"]["smollm2-135m"]["params_m"] > 100  # the real SmolLM2 weights, not a stand-in
