"""Clients and stand-ins for tests, benchmarks and manual checks, kept out of the wheel (pyproject.toml): nothing in
the product (engine_bridge, media, livekit_omni, agents) imports them (tests/test_import_rules.py).

* :mod:`.live_client`: an asyncio client of the Live WebSocket that decodes every server event with the protocol's
  own types (:mod:`livekit_omni.live.wire`), so a frame the types do not accept fails the test that received it.
* :mod:`.webrtc_caller`: an aiortc caller for the WebRTC side (the Live facade's ``POST /v1/live/sessions`` and
  :func:`media.webrtc.answer_offer`).
* :mod:`.fuzz`: seeded fuzzing of every edge where outside bytes enter the server, with its judge
  (``benchmarks/fuzz_edges.py``, ``tests/test_fuzz_edges.py``).
* :mod:`.omni_standin`: a stand-in ``vllm-omni serve`` duplex sidecar (``python -m testkit.omni_standin``), run
  from the repository root (docs/omni-models.md, "The stand-in").
"""
