"""The cascade model adapter (VAD → ASR → thinker → TTS), split by concern:

* :mod:`.adapter` — :class:`CascadeAdapter`, the :class:`~engine_bridge.adapters.base.ModelAdapter` the engine
  drives, and :func:`make_thinker`;
* :mod:`.turns` — the turn machine (audio-thread watch and scheduler-thread handling);
* :mod:`.reply` — one reply and its lifecycle (phases from :mod:`engine_bridge.reply`);
* :mod:`.workers` — the ASR and TTS worker threads;
* :mod:`.messages` — what the other threads post to the scheduler;
* :mod:`.telemetry` — turn records and usage events.
"""

from engine_bridge.adapters.cascade.adapter import CascadeAdapter, CascadeModels, make_thinker

__all__ = ["CascadeAdapter", "CascadeModels", "make_thinker"]
