"""The plugin's version, reported to LiveKit's plugin registry (kept equal to the project's version)."""

from __future__ import annotations

__version__ = "0.1.0"
