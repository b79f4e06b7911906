"""Everything on the engine side of the shared-memory rings.

The ring and control-channel primitives (``ring``, ``protocol``, ``control``, ``formats``) are shared by both
sides; everything else (sessions, turn-taking, model adapters, thinker backends, the scheduler) runs only
inside the engine process. This package never imports ``media``, ``livekit_omni``, ``livekit`` or ``aiortc``.
"""
