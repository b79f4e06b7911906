"""The plugin's logger, named the way LiveKit plugins name theirs so worker log settings apply to it."""

from __future__ import annotations

import logging

logger = logging.getLogger("livekit.plugins.omni")
