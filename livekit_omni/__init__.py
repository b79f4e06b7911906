"""livekit-omni: full-duplex voice sessions for LiveKit rooms, browsers and phone calls.

``from livekit_omni import OmniDuplexModel`` gives the LiveKit Agents plugin. It is loaded on first use (PEP 562
``__getattr__``) rather than here because ``livekit.agents`` costs seconds and ~100 MB to import, and every
``livekit-omni serve`` process and engine tool imports this package without needing it. The first access
imports :mod:`livekit_omni.plugin`, which registers the plugin with LiveKit; agents do that at module top level,
on the main thread, as LiveKit requires.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from livekit_omni.plugin import (
        EngineOccupancy,
        OmniBargeIn,
        OmniDuplexModel,
        OmniOptions,
        OmniReplyDone,
        OmniSession,
    )

__all__ = [
    "EngineOccupancy",
    "OmniBargeIn",
    "OmniDuplexModel",
    "OmniOptions",
    "OmniReplyDone",
    "OmniSession",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from livekit_omni import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module 'livekit_omni' has no attribute {name!r}")
