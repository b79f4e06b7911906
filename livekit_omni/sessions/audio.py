"""Session audio as the dialects carry it in events: the format (encoding and rate) and base64 decoding.

Both dialects name the same three formats (PCM16 at any rate, G.711 µ-law and A-law at 8 kHz) and send audio as
base64 of whole samples; each dialect's wire module writes the format's name its own way.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Literal

from livekit_omni.sessions.errors import WireError

Encoding = Literal["pcm16", "pcmu", "pcma"]


@dataclass(frozen=True, slots=True)
class WireFormat:
    """A session audio format: the encoding on the wire and its sample rate."""

    encoding: Encoding
    rate: int

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.encoding == "pcm16" else 1


def decode_audio(b64: str, fmt: WireFormat, *, param: str = "audio") -> bytes:
    """Base64 audio in ``fmt`` -> raw bytes, checked for whole samples."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise WireError("invalid_audio", "audio is not valid base64", param=param) from None
    if len(raw) % fmt.bytes_per_sample:
        raise WireError(
            "invalid_audio",
            f"audio has {len(raw)} bytes, not a whole number of 16-bit samples",
            param=param,
        )
    return raw
