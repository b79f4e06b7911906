"""Phone calls straight in: the SIP endpoint (docs/sip.md). Each call is a Realtime session whose audio is RTP."""
