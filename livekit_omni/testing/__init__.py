"""Clients for tests, benchmarks and manual checks; nothing in the server or the plugin imports them.

* :mod:`.live_client`: an asyncio client of the Live WebSocket that decodes every server event with the protocol's
  own types (:mod:`livekit_omni.live.wire`), so a frame the types do not accept fails the test that received it.
* :mod:`.webrtc_caller`: an aiortc caller for the WebRTC side (the Live facade's ``POST /v1/live/sessions`` and
  :func:`media.webrtc.answer_offer`).
"""
