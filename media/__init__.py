"""The media plane: codecs, resampling, the ingress writer, the egress player with its 20 ms clock, and WebRTC.

Shared by the OpenAI-Live WebSocket facade, the WebRTC endpoint and the co-located LiveKit plugin. It talks to the
engine only through the shared-memory rings and the control client of ``engine_bridge``.
"""

from __future__ import annotations

from media.codecs import (
    AudioEncoding,
    OpusDecoder,
    OpusEncoder,
    alaw_decode,
    alaw_encode,
    downmix_interleaved,
    parse_encoding,
    pcm16_from_bytes,
    pcm16_to_bytes,
    rms_dbfs,
    ulaw_decode,
    ulaw_encode,
)
from media.egress import EgressPlayer, OutputFrame, TranscriptDelta
from media.ingress import IngressWriter, SessionLike, frame_to_mono_pcm16
from media.pacer import Pacer
from media.resample import IdentityResampler, PolyphaseResampler, Resampler, SoxrResampler
from media.webrtc import (
    DEFAULT_JITTER_PREFETCH,
    AudioJitterBuffer,
    EgressTrack,
    SdpError,
    WebRTCPeer,
    answer_offer,
    disable_loopback_ice,
    enable_loopback_ice,
    loopback_ice_enabled,
    sanitize_offer_sdp,
)

__all__ = [
    "DEFAULT_JITTER_PREFETCH",
    "AudioEncoding",
    "AudioJitterBuffer",
    "EgressPlayer",
    "EgressTrack",
    "IdentityResampler",
    "IngressWriter",
    "OpusDecoder",
    "OpusEncoder",
    "OutputFrame",
    "Pacer",
    "PolyphaseResampler",
    "Resampler",
    "SdpError",
    "SessionLike",
    "SoxrResampler",
    "TranscriptDelta",
    "WebRTCPeer",
    "alaw_decode",
    "alaw_encode",
    "answer_offer",
    "disable_loopback_ice",
    "downmix_interleaved",
    "enable_loopback_ice",
    "frame_to_mono_pcm16",
    "loopback_ice_enabled",
    "parse_encoding",
    "pcm16_from_bytes",
    "pcm16_to_bytes",
    "rms_dbfs",
    "sanitize_offer_sdp",
    "ulaw_decode",
    "ulaw_encode",
]
