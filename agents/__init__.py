"""Runnable LiveKit workers on livekit-omni: ``room_agent`` (rooms) and ``sip_agent`` (phone calls)."""
