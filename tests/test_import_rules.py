"""ARCHITECTURE.md §3: which package may import which. Checked in a fresh interpreter per package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> top-level modules it must never pull in (directly or transitively)
FORBIDDEN: dict[str, list[str]] = {
    "engine_bridge": ["media", "livekit_omni", "livekit", "aiortc", "agents"],
    # The media plane uses the engine's ring/control primitives only, never its models.
    "media": [
        "livekit_omni",
        "livekit",
        "agents",
        "torch",
        "transformers",
        "faster_whisper",
        "piper",
        "ctranslate2",
    ],
    "livekit_omni": ["agents", "torch", "transformers", "faster_whisper", "piper", "ctranslate2"],
}

# Model code must not be reachable from the client-side primitives that media and livekit_omni import.
CLIENT_SIDE = [
    "engine_bridge.ring",
    "engine_bridge.control",
    "engine_bridge.client",
    "engine_bridge.protocol",
]


def _modules_of(package: str) -> list[str]:
    base = ROOT / package
    mods = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods.append(".".join(parts))
    return mods


def _imported_after(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted({k.split('.')[0] for k in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_rules(package: str) -> None:
    loaded = _imported_after(_modules_of(package))
    bad = sorted(set(FORBIDDEN[package]) & loaded)
    assert not bad, f"importing every module of {package} pulls in forbidden {bad}"


def test_agents_only_use_livekit_omni() -> None:
    # agents/ may import livekit_omni (and livekit); it must not reach into engine internals directly.
    for path in (ROOT / "agents").glob("*.py"):
        text = path.read_text()
        assert "engine_bridge" not in text and "from media" not in text and "import media" not in text, path


def test_client_side_primitives_pull_in_no_models() -> None:
    loaded = _imported_after(CLIENT_SIDE)
    bad = sorted({"torch", "transformers", "faster_whisper", "piper", "ctranslate2", "onnxruntime"} & loaded)
    assert not bad, f"client-side engine primitives pull in model libraries: {bad}"
