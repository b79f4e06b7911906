"""livekit-omni as a LiveKit Agents plugin: ``OmniDuplexModel`` and its sessions.

Importing this package registers the plugin with ``livekit.agents.Plugin`` (LiveKit lists registered plugins at
worker start, preloads their packages into the job forkserver, and calls ``download_files`` from
``python -m livekit.agents download-files``). LiveKit only accepts a registration on the main thread; an import
from any other thread (a job thread, an executor) skips it with a debug line instead of failing the import,
because registration changes nothing about how the model works.
"""

from __future__ import annotations

import threading

from livekit.agents import Plugin

# Both connections load here, with the package: LiveKit preloads registered plugin packages into its job
# forkserver, so a job's first session does not pay for importing the media plane.
from livekit_omni.plugin import colocated, remote  # noqa: F401
from livekit_omni.plugin.log import logger
from livekit_omni.plugin.model import OmniDuplexModel
from livekit_omni.plugin.occupancy import EngineOccupancy
from livekit_omni.plugin.options import OmniOptions
from livekit_omni.plugin.session import OmniBargeIn, OmniReplyDone, OmniSession
from livekit_omni.plugin.version import __version__

__all__ = [
    "EngineOccupancy",
    "OmniBargeIn",
    "OmniDuplexModel",
    "OmniOptions",
    "OmniPlugin",
    "OmniReplyDone",
    "OmniSession",
    "__version__",
]


class OmniPlugin(Plugin):
    def __init__(self) -> None:
        super().__init__(__name__, __version__, __package__ or __name__, logger)

    def download_files(self) -> None:
        # Nothing to fetch: the models live with the engine (``livekit-omni serve``), not in the agent worker.
        return None


if threading.current_thread() is threading.main_thread():
    Plugin.register_plugin(OmniPlugin())
else:
    logger.debug("livekit_omni.plugin imported off the main thread; LiveKit plugin registration skipped")
