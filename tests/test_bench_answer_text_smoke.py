"""Smoke test for benchmarks/answer_text.py: a --quick run of two sets completes and its figures add up.

The figures themselves are the benchmark's to read (docs/benchmarks.md); this checks they are there, in range, and
that the top-level keys are the shipped set's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "answer_text.py"

pytestmark = pytest.mark.models


def test_answer_text_quick_reports_each_set() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--sets", "none,shipped"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,  # ~1 min on a quiet machine; the slack is for a loaded one, not a budget
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("shipped ") for line in lines), "expected the table before the JSON line"
    out = json.loads(lines[-1])
    assert set(out["sets"]) == {"none", "shipped"}
    for figures in out["sets"].values():
        for key in ("accuracy_a", "accuracy_b", "name_recall"):
            assert 0.0 <= figures[key] <= 1.0, (key, figures)
        assert figures["openings"] == 3 and 0 <= figures["name_leaks"] <= 3
        assert figures["story_words"] > 0
        # Stories asked for under the default instructions (one in a quick run) and set A's answers' length.
        stories = figures["story_words_default"]
        assert len(stories) == 1 and all(w > 0 for w in stories), figures
        assert figures["story_words_default_mean"] == sum(stories) / len(stories)
        assert figures["short_answer_words_mean"] > 0
    for key in (
        "accuracy_a",
        "accuracy_b",
        "name_recall",
        "name_leaks",
        "story_words",
        "story_words_default",
        "story_words_default_mean",
        "short_answer_words_mean",
    ):
        assert out[key] == out["sets"]["shipped"][key]
