"""Smoke test for benchmarks/tool_router.py: a ``--quick`` run (2 requests of each kind and set, the model's own
``auto`` beside the tool router, each decoded by the engine's default torch thinker) completes and ends with the
JSON its docstring names.

How well the router decides is what the benchmark measures, so precision and recall are not asserted; what is
asserted is that the harness really ran both approaches on both sets with the shipped threshold, and that every
call it made was valid for its tool's schema."""

from __future__ import annotations

import pytest

from engine_bridge.thinker.tool_router import ROUTER_THRESHOLD
from tests.bench_runs import run_benchmark

pytestmark = pytest.mark.models


def test_tool_router_quick_reports_both_approaches_on_both_sets() -> None:
    out, stdout = run_benchmark("tool_router", "--quick", timeout=900)  # ~2 min on this 2-core VM
    assert "approach" in stdout, "expected the table before the JSON line"
    assert out["benchmark"] == "tool_router" and out["quick"] is True
    assert out["threshold_shipped"] == pytest.approx(ROUTER_THRESHOLD, abs=0.01)
    for approach in ("baseline", "router"):
        for set_name in ("A", "B"):
            fig = out[approach][set_name]
            for key in ("call_precision", "call_recall", "args_valid", "args_exact", "calls", "right_calls"):
                assert key in fig, (approach, set_name, key)
            assert fig["calls"] == 0 or fig["args_valid"] == 1.0, fig
    assert out["router"]["A"]["route_ms_p50"] is not None and out["router"]["A"]["route_ms_p50"] > 0
